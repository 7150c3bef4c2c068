"""muond.torch.Muon's memory path for DTensor params with uneven and EMPTY
FSDP2 shards: 4 gloo trainer processes, FSDP2 over 4 ranks on a 3-row weight
(rows 1, 1, 1, 0: rank 3 holds nothing) and a 7-row one (2, 2, 2, 1), each
rank with its own fake daemon (fake_daemon.py, in this process: the wire
contract, uneven gtp_rows included) found from MUOND_DAEMON. Checks: the
0-row shard registers a 0-row view into a buffer of >= 1 element, every
FSDP2 shard (0-row ones too) lives in the shared param buffer while the
optimizer runs (fsdp2_storage: FSDP2 reads and the daemon updates it in
place, no copy), a refusal on one rank
stops every rank before any RPC, and after 2 steps every
rank's full params equal one trainer on one fake daemon given the same full
gradients, bitwise (binding the shards loses nothing)."""
import json
import os
import pickle
import socket
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import trainer_procs  # noqa: E402

WORLD = 4
STEPS = 2
HYPER = dict(lr=0.02, weight_decay=0.1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7))



def _trainer(rank, tmp):
    info = os.path.join(tmp, "daemons.json")
    daemons = trainer_procs.wait_for_json(info, "fake daemons")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(daemons["port"]),
                      RANK=str(rank), MUOND_DAEMON=daemons["addresses"][rank],
                      MUOND_JOB_ID="dtensor-memory")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from muond.torch import Muon

    model = _model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    # A refusal on one rank (a 1-D param in rank 2's Muon group) is raised on
    # every rank, before any RPC, instead of leaving the others waiting.
    bad = list(model.named_parameters()) + ([("odd", torch.nn.Parameter(torch.zeros(3)))]
                                            if rank == 2 else [])
    try:
        Muon([{"params": [(n, p) for n, p in bad if n != "0.bias" and n != "2.bias"]}],
             **HYPER)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    opt = Muon(trainer_procs.groups(list(model.named_parameters())), **HYPER)
    grads = []
    for step in range(STEPS):
        x = torch.randn(5, 5, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    buffers = {b.flat.untyped_storage().data_ptr() for b in opt._buffers}
    outside = [n for n, p in model.named_parameters()
               if p.to_local().untyped_storage().data_ptr() not in buffers]
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    opt.close()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"init": init, "grads": grads, "final": final, "outside": outside,
                     "refusal": refusal}, f)
    dist.destroy_process_group()



class DTensorMemoryTest(unittest.TestCase):
    def test_uneven_and_empty_fsdp2_shards_step_bitwise(self):
        import fake_daemon
        from muond.v1 import muond_pb2 as pb
        tmp = tempfile.mkdtemp(prefix="muond-dtmem-")
        # fork first: no gRPC server exists in the forked children.
        ctx = mp.start_processes(_trainer, args=(tmp,), nprocs=WORLD, join=False,
                                 start_method="fork")
        cluster, addresses = fake_daemon.start_cluster(tmp, WORLD)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with open(os.path.join(tmp, "daemons.json.tmp"), "w") as f:
                json.dump({"port": port, "addresses": addresses}, f)
            os.rename(os.path.join(tmp, "daemons.json.tmp"), os.path.join(tmp, "daemons.json"))
            trainer_procs.join(ctx, 150)
            registered = [{p.name: (p, req.regions) for g in req.groups for p in g.params}
                          for req in (d.requests[0] for d in cluster.daemons)]
        finally:
            for d in cluster.daemons:
                d.stop()
        empty, regions = registered[3]["0.weight"]
        self.assertEqual(list(empty.param.shape), [0, 5])
        self.assertEqual(list(empty.tags.gtp_rows), [1, 1, 1, 0])
        region = next(r for r in regions if r.name == empty.param.region)
        self.assertGreaterEqual(region.byte_size, 4)  # a buffer of >= 1 element
        self.assertEqual(list(registered[3]["2.weight"][0].param.shape), [1, 3])
        self.assertEqual(list(registered[0]["2.weight"][0].tags.gtp_rows), [2, 2, 2, 1])
        self.assertEqual(registered[0]["0.bias"][0].param.shape, [1])

        runs = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                runs.append(pickle.load(f))
        self.assertEqual([run["outside"] for run in runs], [[]] * WORLD)
        refusals = {run["refusal"] for run in runs}
        self.assertEqual(len(refusals), 1, refusals)
        self.assertRegex(refusals.pop(),
                         r"^rank 2: param odd: Muon params must be matrices \(2-D\)")
        self.assertEqual([len(d.requests) for d in cluster.daemons], [1] * WORLD)

        from muond.torch import Muon
        model = _model()
        ref_cluster, ref_addresses = fake_daemon.start_cluster(
            tempfile.mkdtemp(prefix="muond-dtmem-ref-"), 1)
        try:
            opt = Muon(trainer_procs.groups(list(model.named_parameters())), daemons=ref_addresses,
                       job_id="dtensor-memory-ref", **HYPER)
            for step in range(STEPS):
                for n, p in model.named_parameters():
                    p.grad = runs[0]["grads"][step][n].clone()
                opt.step()
            opt.close()
        finally:
            for d in ref_cluster.daemons:
                d.stop()
        for n, p in model.named_parameters():
            self.assertFalse(torch.equal(p.detach(), runs[0]["init"][n]), f"{n} never moved")
            for r in range(WORLD):
                self.assertTrue(torch.equal(runs[r]["final"][n], p.detach()),
                                f"{n} on rank {r}: max diff "
                                f"{(runs[r]['final'][n] - p.detach()).abs().max()}")


if __name__ == "__main__":
    unittest.main()
