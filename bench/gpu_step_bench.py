#!/usr/bin/env python3
"""One Muon optimizer step over a shape set on one GPU, three ways in one run
(issue 8): torch.optim.Muon on identical copies of the params and grads;
muond in-process (bench/gpu:step_bench --engine: the daemon's step engine,
LayerShardedMuon::Step with its non-finite-gradient check, on the CUDA
backend, run as a subprocess between the others; the "kernels" column is the
same phases chained without the engine or the check); muond through the daemon
(muond.torch.Muon: Python client, CUDA IPC, gRPC over a Unix socket). All
three use the same math: simple coefficients x 5, eps 1e-7, `original`
scale, Nesterov, decoupled weight decay, fp32 params, bf16 NS.

Timings: median over --reps steps after --warmup, host clock around the step
with the device synchronised (torch: synchronize after step; muond.torch
synchronises before its RPC and the daemon before it answers). Also: the
Step RPC round trip with (almost) no work, one 8x8 param: p50/p99 µs.

    MUOND_BIN=<bundle>/bin python3 bench/gpu_step_bench.py \
        --manifest bench/manifests/llama3_8b.json --layers 4 --out table.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
from daemon_harness import Daemon, _binary  # noqa: E402

SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)


def shape_set(manifest: str, layers: int):
    params = json.load(open(manifest))["params"]
    keep = [p for p in params if len(p["shape"]) == 2 and
            (m := re.match(r"layers\.(\d+)\.", p["name"])) and int(m.group(1)) < layers]
    return [tuple(p["shape"]) for p in keep]


def ns_flops(shape) -> float:
    m, n = min(shape), max(shape)
    return 5 * (4 * m * m * n + 2 * m ** 3)


def timed(step, reps, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return t[len(t) // 2], t


def fresh(shapes, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [0.02 * torch.randn(s, device="cuda", generator=g) for s in shapes]
    grads = [1e-3 * torch.randn(s, device="cuda", generator=g) for s in shapes]
    return params, grads


def bench_torch(shapes, reps, warmup):
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.Muon(ps, adjust_lr_fn="original", **SETTINGS)
    med, _ = timed(opt.step, reps, warmup)
    del opt, ps, params, grads
    torch.cuda.empty_cache()
    return med


def bench_inprocess(shapes, reps, warmup, ns_batch_size=1, syrk=False, engine=True):
    arg = ",".join(f"{r}x{c}" for r, c in shapes)
    out = subprocess.run([_binary("bench/gpu/step_bench"), f"--shapes={arg}",
                          "--precision=medium", f"--reps={reps}", f"--warmup={warmup}",
                          f"--ns_batch_size={ns_batch_size}"] + (["--use_syrk"] if syrk else [])
                         + (["--engine"] if engine else []),
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"step_ms_median (\S+)", out).group(1))


def bench_daemon(shapes, reps, warmup, job, log_dir, ns_batch_size=1, syrk=False):
    from muond.torch import Muon
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    with Daemon(job, log_dir=log_dir) as d:
        opt = Muon([{"params": ps, "param_names": [f"p{i}" for i in range(len(ps))]}],
                   daemons=[d.address], job_id=job, coefficient_type="simple",
                   scale_mode="original", extra_scale_factor=1.0, fp32_matmul_prec="medium",
                   ns_batch_size=ns_batch_size, use_syrk=syrk, **SETTINGS)
        try:
            opt.zero_grad(set_to_none=False)  # .grad = the shared buffers (zero-copy)
            for p, g in zip(ps, grads):
                p.grad.copy_(g)
            daemon_ms = []
            parts = []

            def step():
                t0 = time.perf_counter()
                opt.step()
                wall = (time.perf_counter() - t0) * 1e6
                daemon_ms.append(opt.last_timings["total_us"] / 1e3)
                parts.append(dict(opt.last_timings, wall_us=wall))

            med, _ = timed(step, reps, warmup)
            dm = sorted(daemon_ms[warmup:])
            print_breakdown(parts[warmup:])
        finally:
            opt.close()
    del ps, params, grads
    torch.cuda.empty_cache()
    return med, dm[len(dm) // 2]


def print_breakdown(parts):
    """Where a daemon step's time goes (medians, ms): the client's Python
    (wall - rpc: grad re-pointing, device sync, overrides), gRPC + server
    (rpc - daemon total), the daemon's phases, and the daemon total not in a
    phase (the non-finite check and its sync, shape timing, bookkeeping)."""
    def med(key):
        v = sorted(p[key] for p in parts)
        return v[len(v) // 2] / 1e3
    phases = ["momentum_us", "a2a_fwd_us", "ns_us", "a2a_bwd_us", "update_us"]
    outside = sorted((p["total_us"] - sum(p[k] for k in phases)) for p in parts)
    print("daemon breakdown (median ms): wall %.2f = client %.2f + rpc %.2f; rpc = "
          "grpc/server %.2f + daemon %.2f; daemon = %s + outside phases %.2f" % (
              med("wall_us"), med("wall_us") - med("rpc_us"), med("rpc_us"),
              med("overhead_us"), med("total_us"),
              " + ".join("%s %.2f" % (k[:-3], med(k)) for k in phases),
              outside[len(outside) // 2] / 1e3), flush=True)


def bench_rpc(reps, job, log_dir):
    from muond.torch import Muon
    p = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    with Daemon(job, log_dir=log_dir) as d:
        opt = Muon([p], daemons=[d.address], job_id=job, coefficient_type="simple",
                   scale_mode="original", **SETTINGS)
        try:
            us = []
            for i in range(reps + 20):
                opt.step()
                if i >= 20:
                    us.append(opt.last_timings["rpc_us"])
        finally:
            opt.close()
    us.sort()
    return us[len(us) // 2], us[int(0.99 * (len(us) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", default=os.path.join(ROOT, "bench/manifests/llama3_8b.json"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2,
                    help="torch / in-process / daemon measured this many times, interleaved")
    ap.add_argument("--ns-batch-size", type=int, default=1,
                    help="muond ns_batch_size (same-shape matrices per batched NS; 1 = unbatched)")
    ap.add_argument("--syrk", action="store_true",
                    help="muond runs the symmetric NS path (use_syrk; same math, "
                         "X X^T and A^2 on their lower triangle)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    a = ap.parse_args()
    shapes = shape_set(a.manifest, a.layers)
    flops = sum(ns_flops(s) for s in shapes)
    rows = []
    for r in range(a.rounds):
        t = bench_torch(shapes, a.reps, a.warmup)
        i = bench_inprocess(shapes, a.reps, a.warmup, a.ns_batch_size, a.syrk)
        kern = bench_inprocess(shapes, a.reps, a.warmup, a.ns_batch_size, a.syrk,
                               engine=False)
        d, dd = bench_daemon(shapes, a.reps, a.warmup, f"bench{r}", a.log_dir,
                             a.ns_batch_size, a.syrk)
        rows.append((t, i, d, dd, kern))
        print(f"round {r + 1}: torch {t:.2f} ms, in-process {i:.2f} ms (kernels {kern:.2f}), "
              f"daemon {d:.2f} ms (daemon-side {dd:.2f})", flush=True)
    p50, p99 = bench_rpc(200, "benchrpc", a.log_dir)
    name = json.load(open(a.manifest))["model"]
    lines = [f"{name}, first {a.layers} layers: {len(shapes)} matrices, "
             f"{flops / 1e12:.2f} TFLOP of NS per step; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}; muond ns_batch_size {a.ns_batch_size}"
             f"{', symmetric NS path (use_syrk)' if a.syrk else ', plain GEMM NS path'}; "
             f"median of {a.reps} steps per cell", "",
             "| round | torch.optim.Muon ms | muond in-process ms | muond daemon ms "
             "(daemon-side) | torch / in-process | torch / daemon | daemon / in-process "
             "| in-process NS TFLOP/s | kernels only ms (torch / kernels) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k, (t, i, d, dd, kern) in enumerate(rows):
        lines.append(f"| {k + 1} | {t:.2f} | {i:.2f} | {d:.2f} ({dd:.2f}) | {t / i:.3f}x | "
                     f"{t / d:.3f}x | {d / i:.3f} | {flops / i / 1e9:.0f} | "
                     f"{kern:.2f} ({t / kern:.3f}x) |")
    lines += ["", f"Step RPC round trip, one 8x8 param (Unix socket): p50 {p50:.0f} µs, "
                  f"p99 {p99:.0f} µs"]
    text = "\n".join(lines)
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
