"""muond.torch.Muon in a torchrun-style job, end to end through the real
binaries: 2 gloo trainer processes, each with FSDP2 (fully_shard, even
Shard(0) rows) and ``Muon(groups)`` with NO daemons= / (g, t) — each finds its
own host daemon from the environment (MUOND_DAEMON, MUOND_JOB_ID,
MUOND_TOKEN_FILE) and its place from the DTensor placements (a 1 x 2 x 1
GTP_remat domain for the matrices, per-rank solo domains for the AdamW
biases) — against a single-daemon run of the same model given the same full
gradients: bitwise (NS in fp32, ns_batch_size 1)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainer_procs  # noqa: E402

from cluster import Cluster, find_binaries  # noqa: E402

WORLD = 2
STEPS = 3
HYPER = dict(lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", ns_batch_size=1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))



def _trainer(rank, tmp):
    """One torchrun rank: waits for the cluster (started after the fork, so
    no gRPC state is forked), then trains STEPS steps."""
    trainer_procs.join_job(rank, tmp, WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from muond.torch import Muon

    model = _model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = Muon(trainer_procs.groups(list(model.named_parameters())), **HYPER)  # the one line
    domains = sorted({pl.domain for pl in opt.places.values()})
    grads = []
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    opt.close()
    trainer_procs.save_result(tmp, rank, {"init": init, "grads": grads, "final": final,
                                          "domains": domains, "places": dict(opt.places)})
    dist.destroy_process_group()



class TorchrunFsdpTest(unittest.TestCase):
    def test_fsdp2_ranks_find_their_daemons_and_match_one_daemon_bitwise(self):
        find_binaries(self)
        from muond.torch import Muon
        runs = trainer_procs.run_job(_trainer, (), WORLD, "muond-torchrun-", 10)
        # One GTP_remat domain of both ranks for the matrices, each rank's own
        # solo domain for the AdamW biases.
        muon_domain = runs[0]["places"]["0.weight"].domain
        self.assertEqual([(run["places"]["0.weight"].G, run["places"]["0.weight"].g)
                          for run in runs], [(2, 0), (2, 1)])
        self.assertEqual(runs[1]["places"]["0.weight"].domain, muon_domain)
        self.assertEqual([run["places"]["0.bias"].domain for run in runs],
                         ["solo-r0", "solo-r1"])

        model = _model()
        for n, p in model.named_parameters():
            self.assertTrue(torch.equal(p.detach(), runs[0]["init"][n]), n)
        with Cluster(1, comm_timeout_s=10) as ref:
            opt = Muon(trainer_procs.groups(list(model.named_parameters())), daemons=ref.daemons,
                       job_id=ref.job_id, **HYPER)
            for step in range(STEPS):
                for n, p in model.named_parameters():
                    p.grad = runs[0]["grads"][step][n].clone()
                opt.step()
            opt.close()
        for n, p in model.named_parameters():
            self.assertFalse(torch.equal(p.detach(), runs[0]["init"][n]), f"{n} never moved")
            for r in range(WORLD):
                self.assertTrue(torch.equal(runs[r]["final"][n], p.detach()),
                                f"{n} on rank {r}: max diff "
                                f"{(runs[r]['final'][n] - p.detach()).abs().max()}")


if __name__ == "__main__":
    unittest.main()
