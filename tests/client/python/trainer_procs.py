"""What the torchrun-style tests (test_torchrun_local, test_dtensor_memory)
share: their param groups and the plumbing of their spawned trainers."""
import json
import os
import socket
import time

ADAMW = dict(algorithm="adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def groups(named):
    """A Muon group of the 2-D params and an AdamW group of the rest."""
    return [{"params": [(n, p) for n, p in named if p.ndim == 2]},
            {"params": [(n, p) for n, p in named if p.ndim != 2], **ADAMW}]


def wait_for_json(path: str, what: str, timeout: float = 60) -> dict:
    """The JSON file the parent writes once its servers run (they start after
    the fork, so no gRPC state is forked)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what}")
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def join(ctx, timeout: float) -> None:
    """Waits for the trainers; a trainer that fails raises, and trainers
    still running after `timeout` s (a rank left waiting) are killed."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"trainers still running after {timeout:.0f}s")


def publish_cluster(tmp: str, cluster) -> None:
    """In the parent, once its contract/cluster.py Cluster runs: writes
    tmp/cluster.json (a free port for the trainers' gloo rendezvous, the
    daemons, the job id and token file) for ``join_job``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(os.path.join(tmp, "cluster.json.tmp"), "w") as f:
        json.dump({"port": port, "daemons": cluster.daemons, "job_id": cluster.job_id,
                   "token_file": os.path.join(cluster.tmp, "token")}, f)
    os.rename(os.path.join(tmp, "cluster.json.tmp"), os.path.join(tmp, "cluster.json"))


def join_job(rank: int, tmp: str, world: int) -> None:
    """In a forked trainer: waits for ``publish_cluster``'s file, takes the
    job's environment as torchrun and `muond launch` give it (its own daemon
    in MUOND_DAEMON) and joins the gloo process group."""
    import torch.distributed as dist
    cluster = wait_for_json(os.path.join(tmp, "cluster.json"), "cluster")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cluster["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), MUOND_DAEMON=cluster["daemons"][rank],
                      MUOND_JOB_ID=cluster["job_id"], MUOND_TOKEN_FILE=cluster["token_file"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
