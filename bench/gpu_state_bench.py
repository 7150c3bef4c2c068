#!/usr/bin/env python3
"""What muond's optimizer-state modes cost on one GPU, side by side in one process: the
step time and the whole GPU's memory in use of a Muon step over a shape set, per row:

  torch          torch.optim.Muon (momentum in the params' dtype, in the process);
  peer           gram-newton-schulz's Muon (Dao-AILab), when it is installed;
  muond <dtype> <location>
                 muond.torch.Muon through a CUDA daemon of its own (bf16 NS, the
                 settings of bench/gpu_step_bench.py), state_dtype fp32 / bf16 /
                 fp8_e4m3, state_location device / host.

Per row: the median step ms (--reps after --warmup, --rounds rounds, the median of the
rounds' medians), its ratio to muond fp32 on the device (the baseline: < 1 is faster)
and to torch, the peak of the GPU's memory in use during the steps above what was in use
before the params were made (GiB; every process: the trainer's tensors and cache, the
daemon's state, staging and NS workspaces), and the daemon's state bytes by location
(GetStatus state_bytes_by).

    MUOND_BIN=<bundle>/bin python3 bench/gpu_state_bench.py --out state.md
    python3 bench/gpu_state_bench.py --set llama3_8b:4 --param-dtype bf16 --modes fp32:device,bf16:device
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

from gpu_memory import GpuUsedPeak  # noqa: E402
from gpu_step_bench import SETTINGS, free, parse_set, shape_set, timed  # noqa: E402

MODES = ["fp32:device", "bf16:device", "fp8_e4m3:device", "fp32:host", "bf16:host",
         "fp8_e4m3:host"]
BASELINE = "muond fp32 device"


def make_params(shapes, dtype):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter((0.02 * torch.randn(s, device="cuda", generator=g)).to(dtype))
          for s in shapes]
    grads = [(1e-3 * torch.randn(s, device="cuda", generator=g)).to(dtype) for s in shapes]
    return ps, grads


def measure(step, reps, warmup):
    """(median ms, peak GiB in use above the start) of `step`."""
    import torch
    torch.cuda.synchronize()
    used = GpuUsedPeak()
    try:
        ms = timed(step, reps, warmup)
    finally:
        peak = used.stop()
    return ms, peak


def run_torch(shapes, dtype, reps, warmup):
    import torch
    used = GpuUsedPeak()  # the params count for everyone
    ps, grads = make_params(shapes, dtype)
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.Muon(ps, adjust_lr_fn="original", **SETTINGS)
    ms = timed(opt.step, reps, warmup)
    peak = used.stop()
    del opt, ps, grads
    free()
    return dict(ms=ms, peak_gib=peak)


def run_peer(shapes, dtype, reps, warmup):
    import torch
    from gpu_step_bench import Peer, warm_until_steady
    used = GpuUsedPeak()
    ps, grads = make_params(shapes, dtype)
    for p, g in zip(ps, grads):
        p.grad = g
    peer = Peer(shapes, "a", ps)
    warm_until_steady(peer.opt.step, "peer")
    ms = timed(peer.opt.step, reps, warmup)
    peak = used.stop()
    peer.opt.state.clear()
    del peer, ps, grads
    free()
    torch.cuda.synchronize()
    return dict(ms=ms, peak_gib=peak)


def run_muond(shapes, dtype, reps, warmup, state_dtype, location, log_dir):
    from daemon_harness import Daemon
    from muond.torch import Muon
    job = re.sub(r"[^a-z0-9]+", "-", f"state-{state_dtype}-{location}")
    with Daemon(job, log_dir=log_dir) as d:
        used = GpuUsedPeak()
        ps, grads = make_params(shapes, dtype)
        opt = Muon([{"params": ps, "param_names": [f"p{i}" for i in range(len(ps))]}],
                   daemons=[d.address], job_id=job, coefficient_type="simple",
                   scale_mode="original", extra_scale_factor=1.0, fp32_matmul_prec="medium",
                   state_dtype=state_dtype, state_location=location, **SETTINGS)
        try:
            opt.zero_grad(set_to_none=False)
            for p, g in zip(ps, grads):
                p.grad.copy_(g)
            ms = timed(opt.step, reps, warmup)
            peak = used.stop()
            status = opt.clients[0].status()
            by = {f"{e.location} {e.dtype}": e.bytes / 2**30
                  for e in getattr(status, "state_bytes_by", [])}
        finally:
            opt.close()
            del ps, grads
            free()
    return dict(ms=ms, peak_gib=peak, state_gib=by)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append",
                   help="NAME_OR_MANIFEST[:LAYERS] (default llama3_8b:4)")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--modes", default=",".join(MODES),
                   help="muond rows, comma list of <state_dtype>:<location>")
    p.add_argument("--no-peers", action="store_true", help="muond rows only")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--log-dir", default="out/state_bench")
    p.add_argument("--out", help="write the markdown table here too")
    a = p.parse_args()
    import torch
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.param_dtype]
    modes = [m.split(":") for m in a.modes.split(",") if m]
    os.makedirs(a.log_dir, exist_ok=True)
    lines = []
    for spec in a.set or ["llama3_8b:4"]:
        name, manifest, layers, _ = parse_set(spec)
        shapes = shape_set(manifest, layers)
        rows: dict[str, list[dict]] = {}
        for r in range(a.rounds):
            if not a.no_peers:
                rows.setdefault("torch", []).append(run_torch(shapes, dtype, a.reps, a.warmup))
                try:
                    import gram_newton_schulz  # noqa: F401
                    rows.setdefault("gram-newton-schulz", []).append(
                        run_peer(shapes, dtype, a.reps, a.warmup))
                except ImportError:
                    pass
            for sd, loc in modes:
                rows.setdefault(f"muond {sd} {loc}", []).append(
                    run_muond(shapes, dtype, a.reps, a.warmup, sd, loc, a.log_dir))
            print(f"{name} round {r + 1}: " + ", ".join(
                f"{k} {v[-1]['ms']:.2f} ms" for k, v in rows.items()), flush=True)
        lines += table(name, layers, a.param_dtype, shapes, rows)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


def table(name, layers, param_dtype, shapes, rows):
    med = {k: statistics.median(x["ms"] for x in v) for k, v in rows.items()}
    base, torch_ms = med.get(BASELINE), med.get("torch")
    out = [f"### {name}, {layers} layers: {len(shapes)} matrices, "
           f"{sum(r * c for r, c in shapes) / 1e9:.2f}B elements, {param_dtype} params", "",
           "| row | step ms | ÷ muond fp32 device | ÷ torch | GPU in use, peak GiB "
           "| daemon state GiB |", "|---|---|---|---|---|---|"]
    for k, v in rows.items():
        state = v[-1].get("state_gib")
        state_text = ", ".join(f"{w} {g:.2f}" for w, g in sorted(state.items())) \
            if state else "-"
        ratio = lambda d: f"{med[k] / d:.3f}" if d else "-"  # noqa: E731
        out.append(f"| {k} | {med[k]:.2f} | {ratio(base)} | {ratio(torch_ms)} | "
                   f"{max(x['peak_gib'] for x in v):.2f} | {state_text} |")
    return out + [""]


if __name__ == "__main__":
    sys.exit(main())
