"""A numpy trainer of 2 DDP ranks for wheel_install_test: run by `muond launch
--nproc-per-node 2 -- python wheel_job.py OUT.npz` in the wheel's venv (no
torch). It drives both ranks from one process: each rank's param and grad
in POSIX shm objects of its own, registered with its daemon
(muond.client.Client, the launcher's MUOND_JOB_ID / MUOND_SOCKET_DIR /
MUOND_TOKEN_FILE), one Step on both, and writes the initial param, the grad
and each rank's updated param to OUT.npz for the test's numpy reference.
"""
import os
import sys
import time
from multiprocessing import shared_memory

import numpy as np

from muond.client import Client
from muond.shm import shm_name
from muond.v1 import muond_pb2 as pb

RANKS = 2
SHAPE = (12, 8)
HYPER = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1)
PLAN_TIMEOUT_S = 60


def shm_array(job: str, values: np.ndarray):
    """values copied into a fresh shm object: (object, fp32 view of it)."""
    name = shm_name(job)
    mem = shared_memory.SharedMemory(name=name.lstrip("/"), create=True, size=values.nbytes)
    view = np.ndarray(values.shape, np.float32, buffer=mem.buf)
    view[...] = values
    return mem, view


def ref(region: str) -> pb.TensorRef:
    return pb.TensorRef(region=region, dtype=pb.DTYPE_FP32, shape=list(SHAPE),
                        strides=[SHAPE[1], 1])


def group(rank: int, param_region: str, grad_region: str) -> pb.ParamGroup:
    muon = pb.MuonHyperparams(**HYPER, coefficient_type=pb.COEFFICIENT_TYPE_SIMPLE,
                              scale_mode=pb.SCALE_MODE_SPECTRAL, num_ns_steps=5,
                              fp32_matmul_prec=pb.MATMUL_PRECISION_HIGHEST)
    return pb.ParamGroup(
        name="dense", algorithm=pb.ALGORITHM_MUON, muon=muon,
        domain=pb.Domain(name="dense", gtp_size=1, tp_size=1, dp_size=RANKS, d=rank),
        params=[pb.Param(name="w", full_shape=list(SHAPE), param=ref(param_region),
                         grad=ref(grad_region))])


def wait_for_plan(clients):
    deadline = time.monotonic() + PLAN_TIMEOUT_S
    while not all(c.health(timeout=10).has_plan for c in clients):
        if time.monotonic() > deadline:
            sys.exit(f"no plan within {PLAN_TIMEOUT_S} s of registering both ranks")
        time.sleep(0.1)


def main():
    out = sys.argv[1]
    job = os.environ["MUOND_JOB_ID"]
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(SHAPE).astype(np.float32)
    grad = rng.standard_normal(SHAPE).astype(np.float32)
    token_file = os.environ.get("MUOND_TOKEN_FILE")
    clients = [Client(f"unix://{os.environ['MUOND_SOCKET_DIR']}/muond-{job}-{r}.sock",
                      timeout=60, token_file=token_file) for r in range(RANKS)]
    memory = []
    try:
        params, futures = [], []
        for rank, client in enumerate(clients):
            pmem, pview = shm_array(job, w0)
            gmem, _ = shm_array(job, grad)
            memory += [pmem, gmem]
            params.append(pview)
            regions = [pb.MemoryRegion(name=m.name, kind=pb.MEMORY_KIND_HOST_SHM,
                                       shm_name="/" + m.name, byte_size=w0.nbytes)
                       for m in (pmem, gmem)]
            futures.append(client.register_future(job, [group(rank, pmem.name, gmem.name)],
                                                  f"wheel-job-{rank}", regions))
        for f in futures:
            f.result()
        wait_for_plan(clients)
        steps = [c.step_future(job, 1, client_id=f"wheel-job-{r}")
                 for r, c in enumerate(clients)]
        for s in steps:
            s.result()
        np.savez(out, w0=w0, grad=grad, **{f"rank{r}": p.copy() for r, p in enumerate(params)})
        for rank, client in enumerate(clients):
            client.unregister(job, f"wheel-job-{rank}")
        print(f"wheel job: stepped {RANKS} ranks")
    finally:
        for client in clients:
            client.close()
        for mem in memory:
            mem.close()
            mem.unlink()


if __name__ == "__main__":
    main()
