"""QK-clip through the real binaries (contract/cluster.py's host daemons).

* Against torch.optim.Muon (NS in fp32) followed by the clip written from
  the paper (qk_clip_reference.py) on full weights: a fused QKV weight
  (MHA), a GQA q/k pair and an unclipped matrix, several steps, maxima above
  and below the threshold, one 0 and one negative; within REL_TOL.
* Bitwise across layouts: 2 trainer processes (gloo) on 2 daemons, FSDP2
  row shards (uneven: 23 + 22 rows), DDP replicas and Megatron-tagged GTP
  shards (a pad row), each rank handing its own per-head maxima to
  reduce_max_logits, equal bit for bit to one process on one daemon.
* A step the daemons refuse (a non-finite gradient) leaves every weight as
  it was, unclipped; the next step clips.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import queue
import sys
import time
import unittest

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "contract"))
import qk_clip_model as M  # noqa: E402
import qk_clip_reference as ref  # noqa: E402
from cluster import Cluster, find_binaries  # noqa: E402
from common import REL_TOL, fp32_newton_schulz, rel_diff  # noqa: E402

from muond.client import MuondError  # noqa: E402
from muond.torch import Muon, QKClip  # noqa: E402

LAYOUTS = ("fsdp", "ddp", "megatron")
# Every layout's run (2 processes on 2 cores) takes seconds; this only stops a hang.
RUN_TIMEOUT_S = 240


def single_process(cluster, steps=M.STEPS, nonfinite_at=None):
    """(full params after ``steps`` on one daemon, the refusals seen)."""
    model = M.Net()
    params = dict(model.named_parameters())
    opt = Muon(list(params.items()), daemons=cluster.daemons, job_id=cluster.job_id,
               token=cluster.token, fp32_matmul_prec="highest", ns_batch_size=1,
               rpc_timeout=30, wait_healthy_timeout=30, name="",
               qk_clip=QKClip(M.layers(params), threshold=M.TAU), **M.MUON_KW)
    refusals = []
    try:
        for step in range(1, steps + 1):
            for name, p in params.items():
                p.grad = M.full_grad(name, step)
            if step == nonfinite_at:
                before = {n: p.detach().clone() for n, p in params.items()}
                params["wq"].grad[0, 0] = math.nan
                try:
                    opt.step(qk_max_logits=M.max_logits(step))
                except MuondError as e:
                    refusals.append((str(e), all(torch.equal(p, before[n])
                                                 for n, p in params.items())))
                params["wq"].grad = M.full_grad("wq", step)
            opt.step(qk_max_logits=M.max_logits(step))
    finally:
        opt.close()
    return {n: p.detach().clone() for n, p in params.items()}, refusals


class QKClipDaemonsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.single = Cluster(1).start()
        cls.addClassCleanup(cls.single.stop)

    def test_against_torch_muon_and_the_paper_clip(self):
        got, _ = single_process(self.single)
        params = {n: torch.nn.Parameter(v.clone()) for n, v in M.full_init().items()}
        unclipped = {n: torch.nn.Parameter(v.clone()) for n, v in M.full_init().items()}
        reference = torch.optim.Muon(list(params.values()), **M.MUON_KW)
        plain = torch.optim.Muon(list(unclipped.values()), **M.MUON_KW)
        clipped_any = False
        for step in range(1, M.STEPS + 1):
            for name in params:
                params[name].grad = M.full_grad(name, step)
                unclipped[name].grad = M.full_grad(name, step)
            with fp32_newton_schulz():
                reference.step()
                plain.step()
            s = M.max_logits(step)
            with torch.no_grad():
                params["qkv"].copy_(ref.clip_fused(params["qkv"], s["attn_fused"], M.TAU, 0.5,
                                                   5, 5, 3))
                q, k = ref.clip_separate(params["wq"], params["wk"], s["attn_gqa"], M.TAU, 0.5,
                                         8, 2, 4)
                params["wq"].copy_(q)
                params["wk"].copy_(k)
            clipped_any = clipped_any or bool((s["attn_gqa"] > M.TAU).any())
        self.assertTrue(clipped_any)
        for name, p in params.items():
            self.assertFalse(torch.isnan(got[name]).any(), name)
            self.assertLess(rel_diff(got[name], p.detach()), REL_TOL, name)
        # The clip moves the Q/K weights far beyond the tolerance, not the others.
        for name in ("qkv", "wq", "wk"):
            self.assertGreater(rel_diff(got[name], unclipped[name].detach()), 100 * REL_TOL)
        self.assertLess(rel_diff(got["out"], unclipped["out"].detach()), REL_TOL)

    def test_a_refused_step_is_not_clipped(self):
        got, refusals = single_process(self.single, steps=2, nonfinite_at=2)
        self.assertEqual(len(refusals), 1)
        message, unchanged = refusals[0]
        self.assertIn("wq", message)
        self.assertTrue(unchanged, "a refused step changed or clipped a weight")
        want, _ = single_process(self.single, steps=2)
        for name in want:
            self.assertTrue(torch.equal(got[name], want[name]), name)

    def test_layouts_are_bitwise_one_process(self):
        want, _ = single_process(self.single)
        with Cluster(M.WORLD, comm_timeout_s=20) as cluster:
            results = self.run_ranks(cluster)
        for layout in LAYOUTS:
            for rank in range(M.WORLD):
                out = results[(layout, rank)]
                self.assertNotIn("error", out, f"{layout} rank {rank}: {out.get('error')}")
                for name, value in want.items():
                    got = torch.from_numpy(out["params"][name])
                    diff = (got - value).abs().max().item()
                    self.assertTrue(torch.equal(got, value),
                                    f"{layout} rank {rank} {name}: max |diff| {diff}")

    def run_ranks(self, cluster) -> dict:
        ctx = multiprocessing.get_context("spawn")
        env = {"daemons": cluster.daemons, "job_id": cluster.job_id,
               "token_file": os.path.join(cluster.tmp, "token"), "tmp": cluster.tmp}
        results = ctx.Queue()
        procs = [ctx.Process(target=M.rank_main, args=(r, env, LAYOUTS, results), daemon=True)
                 for r in range(M.WORLD)]
        for p in procs:
            p.start()
        out = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while len(out) < len(LAYOUTS) * M.WORLD:
                try:
                    layout, rank, answer = results.get(timeout=1.0)
                    out[(layout, rank)] = answer
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.fail(f"trainer ranks {dead} exited or the run passed "
                                  f"{RUN_TIMEOUT_S} s; answers so far {sorted(out)}")
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        return out


if __name__ == "__main__":
    unittest.main()
