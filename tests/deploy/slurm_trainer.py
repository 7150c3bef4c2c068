"""The tiny trainer of tests/deploy/slurm_sbatch_test.py, one torchrun rank:
a 2-layer MLP replicated on every rank (gloo on CPU), gradients averaged with
all_reduce, muond.torch.Muon finding its daemon from the environment the
launcher exports (MUOND_SOCKET_DIR, MUOND_JOB_ID, MUOND_TOKEN_FILE). Writes
OUT/rank<R>.json: where it ran and the final params.

    slurm_trainer.py OUT STEPS [--fail-rank R]   (rank R exits 3 at start)
"""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def daemon_flags(job: str, rank: int) -> dict:
    """--flag=value of this rank's daemon (found in /proc by job and rank)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        flags = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
        if (os.path.basename(argv[0]) == "muond-daemon" and flags.get("job_id") == job
                and flags.get("rank") == str(rank)):
            return flags
    return {}


def main() -> int:
    out, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if sys.argv[3:] == ["--fail-rank", str(rank)]:
        print(f"slurm_trainer: rank {rank} fails on purpose (--fail-rank)", file=sys.stderr)
        return 3
    from muond.torch import Muon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    named = list(model.named_parameters())
    opt = Muon([{"params": [(n, p) for n, p in named if p.ndim == 2]},
                {"params": [(n, p) for n, p in named if p.ndim != 2], "algorithm": "adamw",
                 "lr": 0.01}],
               lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", ns_batch_size=1)
    for step in range(steps):
        # Each rank its own batch; the mean gradient is the same everywhere.
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    opt.close()
    record = {
        "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["GROUP_RANK"]),
        "muond_node_rank": int(os.environ["MUOND_NODE_RANK"]),
        "job_id": os.environ["MUOND_JOB_ID"], "socket_dir": os.environ["MUOND_SOCKET_DIR"],
        "hostname": socket.gethostname(),
        "daemon_flags": daemon_flags(os.environ["MUOND_JOB_ID"], rank),
        "params": {n: p.detach().tolist() for n, p in model.named_parameters()},
    }
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.rename(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
