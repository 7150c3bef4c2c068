"""The trainers of one node of tests/system/multinode_test.py: the command
`muond launch` runs on each node. Like `torchrun --nproc-per-node N` it starts
the node's trainer ranks (forked after importing torch, so torch loads once
per node), RANK = MUOND_NODE_RANK * MUOND_NPROC_PER_NODE + local rank of
WORLD_SIZE = MUOND_NNODES * MUOND_NPROC_PER_NODE, torch.distributed (gloo) at
MASTER_ADDR (default MUOND_MASTER_ADDR), MASTER_PORT. Nothing is passed to
`muond.torch.Muon` but the grid: each rank finds its daemon, job and token
from the launcher's environment (MUOND_SOCKET_DIR, MUOND_JOB_ID,
MUOND_TOKEN_FILE). With RANK set it runs that one rank (under torchrun).

Megatron-tagged local shards of a G x T = 2 x 2 domain, rank = g * T + t: on
two nodes of two ranks the GTP_remat axis (g) is the node, so every NS home's
gather and scatter crosses nodes; the job's commit vote spans all four daemons.
Full initial values and every step's full gradient come from fixed seeds.

    python multinode_trainer.py OUT_DIR [COORDINATOR_CA]

writes OUT_DIR/rank<R>.pt: this rank's final local params, the optimizer's
state tensors (momentum, AdamW moments) and, on rank 0, the NS homes of the
coordinator's plan (GetPlan at MUOND_COORDINATOR with the token, over TLS when
COORDINATOR_CA is given); a rank that fails writes OUT_DIR/rank<R>.err.
"""
from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

STEPS = 3
G, T = 2, 2
# Bitwise across layouts and addresses: NS in fp32, one matrix a batch.
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
               fp32_matmul_prec="highest", ns_batch_size=1)
# name -> (full shape, Megatron partition_dim): four matrices of one NS cost,
# so the plan's homes spread over the ranks of both nodes.
MATRICES = {"q": ((16, 12), 0), "k": ((16, 12), 0), "o": ((12, 16), 1), "down": ((12, 16), 1)}
BIAS = 16  # an AdamW param of every rank (its own solo domain)


def full_value(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def shard(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """`full`'s (g, t) shard as Megatron holds it (muond.split's rule)."""
    buffer = torch.zeros(layout.buffer_numel)
    buffer[:full.numel()].copy_(full.reshape(-1))
    s = layout.shards[rank]
    return buffer.as_strided(s.shape, s.strides, s.offset).clone()


def plan_homes(ca_path: str | None) -> list[tuple[str, int, int]]:
    """(group, g, t) of every NS home in the job's newest plan."""
    import grpc
    from muond.v1 import muond_pb2 as pb
    from muond.v1 import muond_pb2_grpc as pb_grpc
    address = os.environ["MUOND_COORDINATOR"]
    if ca_path:
        with open(ca_path, "rb") as f:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(address)
    with open(os.environ["MUOND_TOKEN_FILE"]) as f:
        token = f.read().strip()
    with channel:
        plan = pb_grpc.CoordinatorStub(channel).GetPlan(
            pb.GetPlanRequest(job_id=os.environ["MUOND_JOB_ID"]), timeout=10,
            metadata=[("x-muond-token", token)])
    return [(grp.group, h.g, h.t) for grp in plan.groups for h in grp.homes]


def run_rank(rank: int, world: int, out_dir: str, ca_path: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from muond import split
    from muond.torch import Muon

    layouts = {n: split.plan_split(shape, G, T, tp_dim) for n, (shape, tp_dim) in
               MATRICES.items()}
    matrices = []
    for i, (name, (shape, _)) in enumerate(MATRICES.items()):
        p = torch.nn.Parameter(shard(full_value(17 + i, shape), layouts[name], rank))
        p.tensor_model_parallel, p.partition_dim = True, layouts[name].tp_dim
        p.is_gtp_weight_remat, p.pad_length = True, layouts[name].pad_length
        p.full_shape = list(shape)
        matrices.append((name, p))
    bias = torch.nn.Parameter(full_value(40 + rank, (BIAS,)))
    initial = {n: p.detach().clone() for n, p in matrices + [("bias", bias)]}
    g, t = divmod(rank, T)
    opt = Muon([{"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices]},
                {"params": [bias], "param_names": ["bias"], "algorithm": "adamw", "lr": 3e-3}],
               **MUON_KW, gtp_size=G, tp_size=T, g=g, t=t, rpc_timeout=60,
               wait_healthy_timeout=60)
    try:
        for step in range(1, STEPS + 1):
            for i, (name, p) in enumerate(matrices):
                p.grad = shard(full_value(1000 * step + i, MATRICES[name][0]), layouts[name],
                               rank)
            bias.grad = full_value(2000 * step + rank, (BIAS,))
            opt.step()
        state = opt.state_dict()["state"]
        homes = plan_homes(ca_path) if rank == 0 else []
    finally:
        opt.close()
    result = {
        "initial": initial,
        "params": {n: p.detach().clone() for n, p in matrices + [("bias", bias)]},
        "state": {f"{i}.{k}": v.detach().clone() for i, entry in state.items()
                  for k, v in entry.items() if torch.is_tensor(v)},
        "homes": homes,
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_forked(rank: int, world: int, out_dir: str, ca_path: str | None) -> int:
    """Forks the process of rank `rank`: its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        run_rank(rank, world, out_dir, ca_path)
        code = 0
    except BaseException:  # noqa: BLE001 (reported to the test in the .err file)
        message = traceback.format_exc()
        sys.stderr.write(f"rank {rank}: {message}")
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(message)
    finally:
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    out_dir = sys.argv[1]
    ca_path = sys.argv[2] if len(sys.argv) > 2 else None
    if "RANK" in os.environ:  # one rank (torchrun)
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), out_dir, ca_path)
        return 0
    node, nproc = int(os.environ["MUOND_NODE_RANK"]), int(os.environ["MUOND_NPROC_PER_NODE"])
    world = int(os.environ["MUOND_NNODES"]) * nproc
    os.environ.setdefault("MASTER_ADDR", os.environ["MUOND_MASTER_ADDR"])
    pids = [run_forked(node * nproc + local, world, out_dir, ca_path) for local in range(nproc)]
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
