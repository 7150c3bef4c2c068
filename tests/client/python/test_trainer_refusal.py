"""A step one trainer refuses on its own checks fails on every rank at once.

Two gloo trainer processes, each with FSDP2 and ``Muon(groups)`` on its own
host daemon (local mode, as test_torchrun_local). At the second step rank 1
edits a fixed entry of its Muon group (``ns_steps``), so its step() raises
the ValueError naming the group and the key before anything is copied. Its
daemon is told (StepRequest.trainer_refusal) and the job votes: rank 0's
step() fails with the refusal naming rank 1 and its trainer's checks, not
the communicator timeout (the daemons' is set far above the harness's). No
rank changes anything; rank 1 puts the entry back and both send the same
step again, which then matches a run that never saw the refusal, bitwise.
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainer_procs  # noqa: E402

from cluster import find_binaries  # noqa: E402

WORLD = 2
STEPS = 3
REFUSING_RANK = 1
HYPER = dict(lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", ns_batch_size=1)
# A refusal that waited for the communicator would take this long: far
# beyond the harness's join timeout, so such a run fails instead of passing.
COMM_TIMEOUT_S = 600


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _grads(model, step, rank):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).pow(2).mean().backward()


def _trainer(rank, tmp, refuse):
    trainer_procs.join_job(rank, tmp, WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from muond.client import MuondError
    from muond.torch import Muon

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = Muon(trainer_procs.groups(list(model.named_parameters())), **HYPER)
    out = {"errors": []}
    for step in range(STEPS):
        opt.zero_grad()
        _grads(model, step, rank)
        if refuse and step == 1:
            before = {n: p.full_tensor() for n, p in model.named_parameters()}
            kept = opt.param_groups[0]["ns_steps"]
            if rank == REFUSING_RANK:
                opt.param_groups[0]["ns_steps"] = kept + 2
            try:
                opt.step()
                out["errors"].append(None)
            except (ValueError, MuondError) as e:
                out["errors"].append((type(e).__name__, str(e), getattr(e, "reason", None),
                                      dict(getattr(e, "metadata", None) or {})))
            opt.param_groups[0]["ns_steps"] = kept
            out["unchanged"] = all(torch.equal(p.full_tensor(), before[n])
                                   for n, p in model.named_parameters())
            out["step_id_after_refusal"] = opt.step_id
        opt.step()
    out["final"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    opt.close()
    trainer_procs.save_result(tmp, rank, out)
    dist.destroy_process_group()


def _run_job(refuse: bool) -> list:
    return trainer_procs.run_job(_trainer, (refuse,), WORLD, "muond-refusal-", COMM_TIMEOUT_S)


class TrainerRefusalTest(unittest.TestCase):
    def test_one_trainers_refusal_fails_the_step_on_every_rank_at_once(self):
        find_binaries(self)
        runs = _run_job(refuse=True)
        kind, message, _, _ = runs[REFUSING_RANK]["errors"][0]
        self.assertEqual(kind, "ValueError")
        self.assertIn("ns_steps", message)
        kind, message, reason, metadata = runs[1 - REFUSING_RANK]["errors"][0]
        self.assertEqual(kind, "MuondError", message)
        self.assertEqual(reason, "TRAINER_REFUSED", message)
        self.assertEqual(metadata, {"ranks": str(REFUSING_RANK)}, message)
        self.assertIn(f"rank {REFUSING_RANK}", message)
        self.assertIn("trainer", message)
        self.assertNotIn("timeout", message.lower())
        for r, run in enumerate(runs):
            self.assertTrue(run["unchanged"], f"rank {r} changed params in a refused step")
            self.assertEqual(run["step_id_after_refusal"], 1, f"rank {r}")

        clean = _run_job(refuse=False)
        for r in range(WORLD):
            for n, want in clean[r]["final"].items():
                self.assertTrue(torch.equal(runs[r]["final"][n], want),
                                f"{n} on rank {r}: the refused step left a trace")


if __name__ == "__main__":
    unittest.main()
