"""What the torchrun-style tests (test_torchrun_local, test_dtensor_memory,
test_trainer_refusal, test_overlap_checks) share: their param groups and the
plumbing of their spawned trainers."""
import json
import os
import pickle
import socket
import tempfile
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


def save_result(tmp: str, rank: int, result) -> None:
    """In a trainer: what it hands back to ``run_job`` / ``load_results``."""
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def load_results(tmp: str, world: int) -> list:
    """Every rank's ``save_result``, in rank order."""
    runs = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
            runs.append(pickle.load(f))
    return runs


def run_job(trainer, args: tuple, world: int, prefix: str, comm_timeout_s: int,
            timeout: float = 150) -> list:
    """``world`` forked trainers, ``trainer(rank, tmp, *args)``, each with its
    own host daemon of a contract/cluster.py Cluster (its daemons'
    --comm_timeout_s ``comm_timeout_s``), joined within ``timeout`` s; their
    ``save_result``s in rank order. Forked before the servers start, so no
    gRPC state is forked; the caller has contract/ on sys.path."""
    import torch.multiprocessing as mp
    from cluster import Cluster
    tmp = tempfile.mkdtemp(prefix=prefix)
    ctx = mp.start_processes(trainer, args=(tmp, *args), nprocs=world, join=False,
                             start_method="fork")
    with Cluster(world, comm_timeout_s=comm_timeout_s) as cluster:
        publish_cluster(tmp, cluster)
        join(ctx, timeout)
    return load_results(tmp, world)
