"""A tiny trainer for muond launch's tests: what a user's train.py does,
reading only the environment (torchrun's RANK/WORLD_SIZE/MASTER_*, the
launcher's MUOND_*): gloo, a two-matrix MLP replicated on every rank (DDP:
gradients averaged by all_reduce), muond.torch.Muon with no daemons= (it
finds its rank's daemon in $MUOND_SOCKET_DIR). Each rank trains on its slice
of a global batch drawn from a fixed seed, so the test can replay the job in
one process (test_launch_end_to_end.py's reference).

    python launch_trainer.py OUT_DIR [--steps N] [--slow | --stubborn]

Rank r writes OUT_DIR/rank<r>.json: the environment it saw, whether its
daemon's socket existed, and (rank 0) the initial and final parameters.
--slow: after the first step writes OUT_DIR/stepped, keep stepping (0.2 s
apart) up to --steps (a test kills a daemon meanwhile). --stubborn: after
the first step (its shm objects made), ignore SIGTERM, write its pid to
OUT_DIR/stubborn and sleep until killed (what a hung worker does to a stop).
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist

HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)
MUOND_OPTIONS = dict(coefficient_type="simple", scale_mode="original", extra_scale_factor=1.0,
                     fp32_matmul_prec="highest", weight_decay_method="decoupled")
SHAPES = [(16, 8), (4, 16)]  # Linear(8, 16), Linear(16, 4), no bias
GLOBAL_BATCH = 8
EXPORTED = ("MUOND_JOB_ID", "MUOND_TOKEN_FILE", "MUOND_SOCKET_DIR", "MUOND_COORDINATOR",
            "MUOND_NNODES", "MUOND_NODE_RANK", "MUOND_NPROC_PER_NODE", "MUOND_MASTER_ADDR",
            "RANK", "WORLD_SIZE")


def initial_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) / s[1] ** 0.5 for s in SHAPES]


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def loss_fn(params, x, y):
    return ((torch.tanh(x @ params[0].T) @ params[1].T - y) ** 2).mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--slow", action="store_true")
    p.add_argument("--stubborn", action="store_true")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = os.environ["MUOND_JOB_ID"]
    sock = os.path.join(os.environ["MUOND_SOCKET_DIR"], f"muond-{job}-{rank}.sock")
    seen = {"env": {k: os.environ.get(k) for k in EXPORTED}, "socket_existed":
            os.path.exists(sock), "pid": os.getpid()}
    dist.init_process_group("gloo")
    from muond.torch import Muon
    params = [torch.nn.Parameter(t.clone()) for t in initial_params()]
    opt = Muon([{"params": params, "param_names": ["w1", "w2"]}], **HYPER, **MUOND_OPTIONS)
    per = GLOBAL_BATCH // world
    for step in range(a.steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_fn(params, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        for prm in params:
            dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        if a.stubborn:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            path = os.path.join(a.out, "stubborn")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            while True:
                time.sleep(1)
        if a.slow:
            if step == 0 and rank == 0:
                open(os.path.join(a.out, "stepped"), "w").close()
            time.sleep(0.2)
    if rank == 0:
        seen["final"] = [prm.detach().tolist() for prm in params]
    opt.close()
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
