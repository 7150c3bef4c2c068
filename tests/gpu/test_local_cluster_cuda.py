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
2. Five create -> step -> `del` cycles (no close(), no gc.collect()) leave no
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import cuda_or_skip  # noqa: E402

SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)
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
    print(json.dumps({"two": two_optimizers(torch), "cycles": cycles(torch)}))
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
    two, cyc = out["two"], out["cycles"]
    checks = [
        ("two optimizers match torch.optim.Muon (<= 1e-2)", two["worst_rel"] <= 1e-2,
         f"worst {two['worst_rel']:.3e}"),
        ("two optimizers are two instances", two["names"][0] != two["names"][1],
         f"names {two['names']}"),
        ("params stay on the GPU", two["on_cuda"], ""),
        ("a local cluster served them", bool(two["dir"]) and bool(two["pids"]),
         f"dir {two['dir']} pids {two['pids']}"),
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
