#!/usr/bin/env python3
"""The drop-in comparison: a user replaces ``torch.optim.Muon(ps,
**args)`` by ``muond.torch.Muon(ps, **args, daemons=..., job_id=...)`` with the
SAME arguments (so muond's defaults: fp32_matmul_prec "medium", torch's
coefficients and scale) and keeps the usual loop:

    opt.zero_grad()            # set_to_none=True, torch's default
    <backward: fresh .grad tensors>
    opt.step()

The fresh grads are new tensors each step (as backward makes them after
zero_grad(set_to_none=True)), so muond copies them into its shared buffers at
step() (one batched copy); a third column shows the zero-copy loop
(zero_grad(set_to_none=False) and gradients accumulated in place).

Timings: median over --reps steps after --warmup, host clock around
zero_grad + grad assignment + step with the device synchronised, torch and
muond interleaved per round.

    MUOND_BIN=<bundle>/bin python3 bench/gpu_dropin_bench.py \
        --manifest bench/manifests/llama3_8b.json --layers 4 --out table.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
from daemon_harness import Daemon  # noqa: E402
from gpu_step_bench import fresh, shape_set, timed  # noqa: E402

# torch.optim.Muon's own defaults but a larger lr (as a user would set it).
ARGS = dict(lr=0.02)


def loop(opt, ps, grads, set_to_none: bool):
    """One training step's optimizer work: zero_grad, the new grads, step."""
    def step():
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            for p, g in zip(ps, grads):
                p.grad = g.clone()  # backward's fresh tensor
        else:
            for p, g in zip(ps, grads):
                p.grad.add_(g)      # backward accumulating in place
        opt.step()
    return step


def bench_torch(shapes, reps, warmup):
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    opt = torch.optim.Muon(ps, **ARGS)
    med, _ = timed(loop(opt, ps, grads, True), reps, warmup)
    del opt, ps, params, grads
    torch.cuda.empty_cache()
    return med


def bench_muond(shapes, reps, warmup, job, log_dir, set_to_none):
    from muond.torch import Muon
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    with Daemon(job, log_dir=log_dir) as d:
        opt = Muon(ps, **ARGS, daemons=[d.address], job_id=job)
        try:
            med, _ = timed(loop(opt, ps, grads, set_to_none), reps, warmup)
        finally:
            opt.close()
    del ps, params, grads
    torch.cuda.empty_cache()
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=os.path.join(ROOT, "bench/manifests/llama3_8b.json"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shapes = shape_set(a.manifest, a.layers)
    rows = []
    for r in range(a.rounds):
        t = bench_torch(shapes, a.reps, a.warmup)
        m = bench_muond(shapes, a.reps, a.warmup, f"dropin{r}", a.log_dir, True)
        z = bench_muond(shapes, a.reps, a.warmup, f"dropin{r}z", a.log_dir, False)
        rows.append((t, m, z))
        print(f"round {r + 1}: torch {t:.2f} ms, muond {m:.2f} ms, muond zero-copy {z:.2f} ms",
              flush=True)
    name = json.load(open(a.manifest))["model"]
    lines = [f"{name}, first {a.layers} layers: {len(shapes)} matrices; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; same arguments "
             f"{ARGS} to both optimizers (muond's defaults otherwise); median of {a.reps} "
             "steps of zero_grad + grads + step", "",
             "| round | torch.optim.Muon ms | muond.torch.Muon ms (zero_grad()) | "
             "torch / muond | muond zero-copy ms (zero_grad(set_to_none=False)) | "
             "torch / zero-copy |", "|---|---|---|---|---|---|"]
    for k, (t, m, z) in enumerate(rows):
        lines.append(f"| {k + 1} | {t:.2f} | {m:.2f} | {t / m:.3f}x | {z:.2f} | {t / z:.3f}x |")
    text = "\n".join(lines)
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
