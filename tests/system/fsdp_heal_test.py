"""A job that heals: 2 torchrun-style gloo trainers with FSDP2 (fully_shard)
and muond.torch.Muon, each on its own host daemon (--comm_timeout_s=3), meet a
fault at step FAULT_STEP and then train on without re-registering:

* partial: rank 1 skips one step() call. Rank 0's step fails with PEER_GONE
  (nothing applied) once the job vote times out; the daemons rebuild their
  communicators under a new epoch, keeping their state.
* sigstop: rank 1's daemon is SIGSTOPped before the step and SIGCONTed once
  rank 0's step has failed; both trainers' steps fail with PEER_GONE.

Then every rank resends the step and takes 5 more; the params equal, bitwise,
those of the same job run without the fault.
"""
import json
import os
import pickle
import signal
import sys
import tempfile
import time
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python", "contract"))
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import trainer_procs  # noqa: E402
from cluster import Cluster, find_binaries, wait_for  # noqa: E402

WORLD = 2
FAULT_STEP = 2
STEPS = FAULT_STEP + 1 + 5
COMM_TIMEOUT_S = 3
HYPER = dict(lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", ns_batch_size=1,
             rpc_timeout=60)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _touch(path):
    with open(path, "w"):
        pass


def _failed_step(opt):
    """opt.step() that must fail as a lost peer's step does; the error."""
    from muond.client import PEER_GONE, MuondError
    try:
        opt.step()
    except MuondError as e:
        assert e.reason == PEER_GONE, e
        return str(e)
    raise AssertionError(f"step {opt.step_id + 1} did not fail")


def _fault(rank, opt, fault, tmp):
    """The faulted step on `rank`; afterwards both ranks resend it."""
    if fault == "partial":
        if rank == 0:
            _failed_step(opt)
    elif fault == "sigstop":
        if rank == 0:
            _touch(os.path.join(tmp, "stop_request"))
            trainer_procs.wait_for_json(os.path.join(tmp, "stopped"), "the stopped daemon")
        dist.barrier()
        _failed_step(opt)
        if rank == 0:
            _touch(os.path.join(tmp, "failed"))
    dist.barrier()


def _trainer(rank, tmp, fault):
    trainer_procs.join_job(rank, tmp, WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from muond.torch import Muon

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    opt = Muon(trainer_procs.groups(list(model.named_parameters())), **HYPER)
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if step == FAULT_STEP and fault:
            _fault(rank, opt, fault, tmp)
        opt.step()
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    step_id = opt.step_id
    opt.close()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"final": final, "step_id": step_id}, f)
    dist.destroy_process_group()


def _stop_and_continue(cluster, tmp, ctx):
    """The sigstop fault's operator: SIGSTOP rank 1's daemon when rank 0
    asks, SIGCONT it once rank 0's step failed."""
    daemon = cluster.process("muond-rank1")

    def trainers_alive():
        if any(not p.is_alive() for p in ctx.processes):
            raise RuntimeError("a trainer ended before the fault")
        return True
    wait_for(lambda: trainers_alive() and os.path.exists(os.path.join(tmp, "stop_request")),
             60, "the trainers at the faulted step")
    daemon.send_signal(signal.SIGSTOP)
    try:
        with open(os.path.join(tmp, "stopped"), "w") as f:
            json.dump({}, f)
        wait_for(lambda: trainers_alive() and os.path.exists(os.path.join(tmp, "failed")),
                 60, "rank 0's failed step")
    finally:
        daemon.send_signal(signal.SIGCONT)


def run_job(fault):
    """Every rank's final full params and step id after the job with `fault`."""
    tmp = tempfile.mkdtemp(prefix="muond-heal-")
    ctx = mp.start_processes(_trainer, args=(tmp, fault), nprocs=WORLD, join=False,
                             start_method="fork")
    try:
        with Cluster(WORLD, comm_timeout_s=COMM_TIMEOUT_S) as cluster:
            trainer_procs.publish_cluster(tmp, cluster)
            if fault == "sigstop":
                _stop_and_continue(cluster, tmp, ctx)
            trainer_procs.join(ctx, 150)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    runs = []
    for r in range(WORLD):
        with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
            runs.append(pickle.load(f))
    return runs


class FsdpHealTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.clean = run_job(None)

    def check_bitwise_clean(self, runs):
        init = dict(_model().named_parameters())
        for r in range(WORLD):
            self.assertEqual(runs[r]["step_id"], STEPS)
            for n, p in self.clean[r]["final"].items():
                self.assertFalse(torch.equal(p, init[n].detach()), f"{n} never moved")
                self.assertTrue(torch.equal(runs[r]["final"][n], p),
                                f"{n} on rank {r}: max diff "
                                f"{(runs[r]['final'][n] - p).abs().max()}")

    def test_a_step_one_rank_skips_is_resent_and_the_job_trains_on_bitwise(self):
        self.check_bitwise_clean(run_job("partial"))

    def test_a_stopped_then_continued_daemon_rejoins_and_the_job_trains_on_bitwise(self):
        self.check_bitwise_clean(run_job("sigstop"))


if __name__ == "__main__":
    unittest.main()
