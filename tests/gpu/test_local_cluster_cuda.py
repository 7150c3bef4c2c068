#!/usr/bin/env python3
"""A plain `python train.py` on a GPU (tag gpu): with no launcher, torchrun or
daemon address, muond.torch.Muon starts its own local cluster, a coordinator
and a daemon on the params' device (CUDA IPC), and stops it at the end.

In a child process whose environment names no job (the server binaries come
from the usual lookup: an installed wheel, $MUOND_BIN_DIR or the checkout):

1. Two live optimizers on two models (a generator and a discriminator) share
   the local cluster; each steps its model 5 times beside torch.optim.Muon
   (bf16 Newton-Schulz on both sides): every param within 1e-2 relative
   (bf16 rounding), and the models' params stay on the GPU.
2. fp16 params on the GPU, a Muon group and an AdamW group, fp32 NS
   ("highest"): 3 steps equal an independent float64 reference
   (torch.optim.Muon with its NS in fp32, torch_ns_fp32, and torch.optim.AdamW on the CPU,
   each param rounded to fp16 after every step as fp16 storage does) within
   fp16 rounding: two units in the last place of the value and of the move.
3. Five create -> step -> `del` cycles (no close(), no gc.collect()) leave no
   server process, no private directory and the device's free memory at its
   baseline.
Exit code 0 = pass; prints one line per check. Needs a GPU; prints SKIP
without one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
from daemon_harness import cuda_or_skip  # noqa: E402
from torch_ns_fp32 import torch_muon_ns_in_fp32  # noqa: E402  (imports torch)

SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
MIB = 1 << 20
FREE_SLACK = 16 * MIB  # bookkeeping; one cycle's buffers are ~40 MiB
# The launcher's and torchrun's variables: any of them makes a job, not a
# plain script (muond.torch.discovery.JOB_VARIABLES).
JOB_VARIABLES = ("MUOND_DAEMON", "MUOND_SOCKET_DIR", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
                 "MUOND_COORDINATOR", "MUOND_NNODES", "MUOND_NPROC_PER_NODE", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "MUOND_LOCAL")


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def paired(torch, seed: int, shapes):
    g = torch.Generator(device="cuda").manual_seed(seed)
    init = [0.02 * torch.randn(*s, device="cuda", generator=g) for s in shapes]
    return ([torch.nn.Parameter(t.clone()) for t in init],
            [torch.nn.Parameter(t.clone()) for t in init])


def muond_opt(params):
    from muond.torch import Muon
    return Muon(params, coefficient_type="simple", scale_mode="original",
                extra_scale_factor=1.0, fp32_matmul_prec="medium",
                weight_decay_method="decoupled", **SETTINGS)


def two_optimizers(torch) -> dict:
    import muond.local
    gen_ref, gen = paired(torch, 0, [(512, 256), (256, 512)])
    dis_ref, dis = paired(torch, 1, [(128, 512), (64, 128)])
    ours = [muond_opt(gen), muond_opt(dis)]
    theirs = [torch.optim.Muon(gen_ref, adjust_lr_fn="original", **SETTINGS),
              torch.optim.Muon(dis_ref, adjust_lr_fn="original", **SETTINGS)]
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(5):
        for mine, ref in ((gen, gen_ref), (dis, dis_ref)):
            for p, q in zip(mine, ref):
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
                q.grad = p.grad.clone()
        for opt in ours + theirs:
            opt.step()
    worst = max(rel(p, q) for p, q in zip(gen + dis, gen_ref + dis_ref))
    cluster = muond.local.current()
    info = {"worst_rel": worst, "names": [o.name for o in ours],
            "on_cuda": all(p.is_cuda for p in gen + dis),
            "dir": cluster.directory if cluster else None,
            "pids": [s.proc.pid for s in cluster.servers] if cluster else []}
    for opt in ours:
        opt.close()
    return info


def fp16_params(torch) -> dict:
    from muond.torch import Muon
    g = torch.Generator().manual_seed(3)
    init = {"w1": 0.05 * torch.randn(256, 128, generator=g),
            "w2": 0.05 * torch.randn(64, 256, generator=g),
            "bias": 0.1 * torch.randn(64, generator=g)}
    mine = {n: torch.nn.Parameter(t.half().cuda()) for n, t in init.items()}
    ref = {n: torch.nn.Parameter(t.half().double()) for n, t in init.items()}
    start = {n: p.detach().clone() for n, p in ref.items()}
    opt = Muon([{"params": [mine["w1"], mine["w2"]]},
                {"params": [mine["bias"]], "algorithm": "adamw", **ADAMW}],
               coefficient_type="simple", scale_mode="original", extra_scale_factor=1.0,
               fp32_matmul_prec="highest", weight_decay_method="decoupled", **SETTINGS)
    ref_muon = torch.optim.Muon([ref["w1"], ref["w2"]], adjust_lr_fn="original", **SETTINGS)
    ref_adamw = torch.optim.AdamW([ref["bias"]], **ADAMW)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        for n in init:
            grad = torch.randn(init[n].shape, generator=gen).half()
            mine[n].grad, ref[n].grad = grad.cuda(), grad.double()
        opt.step()
        with torch_muon_ns_in_fp32():
            ref_muon.step()
        ref_adamw.step()
        with torch.no_grad():  # the reference's params stored in fp16
            for p in ref.values():
                p.copy_(p.half().double())
    opt.close()
    ulps = 2 * torch.finfo(torch.float16).eps
    worst, moved = -float("inf"), float("inf")
    for n in init:
        got, want = mine[n].detach().double().cpu(), ref[n].detach()
        # fp16 rounding: two fp16 ulps of the element's larger magnitude,
        # before or after (a one-ulp difference made while it was large stays
        # that size as the value moves towards 0), plus two ulps of the
        # param's largest move (the update itself is rounded as fp16 math
        # rounds it; torch rounds it coarser, to bf16).
        move = float((want - start[n]).abs().max())
        scale = torch.maximum(want.abs(), start[n].abs()) + move
        excess = ((got - want).abs() - ulps * scale - 1e-7).max()
        worst = max(worst, float(excess))
        moved = min(moved, float((want - start[n]).abs().max() / want.abs().max()))
    return {"worst_excess": worst, "dtype_kept": all(p.dtype == torch.float16
                                                      for p in mine.values()),
            "min_moved": moved, "ulps": ulps}


def cycles(torch) -> dict:
    import muond.local
    from muond.launch.processes import is_alive
    params, _ = paired(torch, 2, [(1024, 1024), (256, 1024)])
    left = []
    free = []
    for _ in range(5):
        opt = muond_opt(params)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        cluster = muond.local.current()
        directory, pids = cluster.directory, [s.proc.pid for s in cluster.servers]
        del opt
        left += [pid for pid in pids if is_alive(pid)]
        left += [directory] if os.path.exists(directory) else []
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free.append(torch.cuda.mem_get_info()[0])
    return {"left": left, "free": free}


def child() -> int:
    import gc
    import torch
    gc.disable()  # reference counting alone ends a dropped optimizer
    print(json.dumps({"two": two_optimizers(torch), "fp16": fp16_params(torch),
                      "cycles": cycles(torch)}))
    return 0


def main() -> int:
    if not cuda_or_skip():
        return 0
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout[-4000:], run.stderr[-4000:])
        print("FAIL: the child exited", run.returncode)
        return 1
    out = json.loads(run.stdout.strip().splitlines()[-1])
    two, fp16, cyc = out["two"], out["fp16"], out["cycles"]
    checks = [
        ("two optimizers match torch.optim.Muon (<= 1e-2)", two["worst_rel"] <= 1e-2,
         f"worst {two['worst_rel']:.3e}"),
        ("two optimizers are two instances", two["names"][0] != two["names"][1],
         f"names {two['names']}"),
        ("params stay on the GPU", two["on_cuda"], ""),
        ("a local cluster served them", bool(two["dir"]) and bool(two["pids"]),
         f"dir {two['dir']} pids {two['pids']}"),
        ("fp16 params equal the float64 reference within fp16 rounding",
         fp16["worst_excess"] <= 0 and fp16["dtype_kept"],
         f"worst excess {fp16['worst_excess']:.3e}, dtype kept {fp16['dtype_kept']}"),
        ("the fp16 steps moved every param beyond the tolerance",
         fp16["min_moved"] > 4 * fp16["ulps"], f"smallest move {fp16['min_moved']:.3e}"),
        ("dropped optimizers leave no server or directory", not cyc["left"],
         f"left {cyc['left']}"),
        ("free device memory at baseline after each cycle",
         max(cyc["free"]) - min(cyc["free"]) <= FREE_SLACK,
         "free MiB " + ", ".join(f"{f / MIB:.0f}" for f in cyc["free"])),
    ]
    failed = 0
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {name} {detail}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(child() if "--child" in sys.argv else main())
