"""The model, gradients, maxima and layouts of test_qk_clip_daemons, and its
trainer processes' side (``rank_main``).

Three attention weights with uneven row counts and one unclipped matrix:
``qkv``, Megatron's fused linear_qkv of 5 heads (MHA) of head_dim 3 (45 rows:
FSDP2's chunks 23 + 22, a GTP pad row on 2 ranks), and a GQA pair ``wq`` (8
heads x 4 rows) / ``wk`` (2 key heads x 4 rows). Full values, full
gradients and the job-wide maxima of every step come from fixed seeds, so
every layout sees the same ones."""
from __future__ import annotations

import datetime
import os
import traceback

import torch

SHAPES = {"qkv": (45, 16), "wq": (32, 16), "wk": (8, 16), "out": (16, 24)}
HEADS = {"attn_fused": 5, "attn_gqa": 8}
TAU = 10.0
STEPS = 3
MUON_KW = dict(lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)
WORLD = 2


def full_init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g) * 0.5 for n, s in sorted(SHAPES.items())}


def full_grad(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g)


def max_logits(step: int) -> dict[str, torch.Tensor]:
    """Job-wide maxima: some heads above TAU, some below, one at 0 and one
    negative every step."""
    out = {}
    for i, (layer, n) in enumerate(sorted(HEADS.items())):
        g = torch.Generator().manual_seed(500 * step + i)
        s = torch.rand(n, generator=g) * 3 * TAU
        s[0], s[1], s[2] = 0.0, -2.5, 2.5 * TAU
        out[layer] = s
    return out


def rank_maxima(step: int, rank: int) -> dict[str, torch.Tensor]:
    """What one rank saw: the job-wide maximum of the heads h with h % WORLD
    == rank, less elsewhere (the MAX over ranks is ``max_logits``)."""
    out = {}
    for layer, s in max_logits(step).items():
        mine = torch.arange(s.numel()) % WORLD == rank
        out[layer] = torch.where(mine, s, s - 7.0)
    return out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for name, value in full_init().items():
            setattr(self, name, torch.nn.Parameter(value.clone()))


def layers(params: dict):
    from muond.torch import QKClipAttention
    return [QKClipAttention("attn_fused", num_heads=5, head_dim=3, qkv=params["qkv"]),
            QKClipAttention("attn_gqa", num_heads=8, num_kv_heads=2, head_dim=4,
                            q=params["wq"], k=params["wk"])]


# -- the trainer processes ------------------------------------------------------
def _megatron_params(rank: int):
    """This rank's GTP (G = 2) local shards with Megatron's tags (muond.split's rule)."""
    from muond import split
    out, layouts = {}, {}
    for name, full in full_init().items():
        layout = split.plan_split(full.shape, WORLD, 1)
        buffer = torch.zeros(layout.buffer_numel)
        buffer[:full.numel()] = full.reshape(-1)
        s = layout.shards[rank]
        p = torch.nn.Parameter(buffer.as_strided(s.shape, s.strides, s.offset).clone())
        p.is_gtp_weight_remat, p.pad_length = True, layout.pad_length
        p.full_shape = list(full.shape)
        out[name], layouts[name] = p, layout
    return out, layouts


def _shard(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    buffer = torch.zeros(layout.buffer_numel)
    buffer[:full.numel()] = full.reshape(-1)
    s = layout.shards[rank]
    return buffer.as_strided(s.shape, s.strides, s.offset).clone()


def _unshard(shards, layout) -> torch.Tensor:
    buffer = torch.zeros(layout.buffer_numel)
    for s, value in zip(layout.shards, shards):
        buffer.as_strided(s.shape, s.strides, s.offset).copy_(value)
    return buffer[:layout.full_shape[0] * layout.full_shape[1]].view(layout.full_shape)


def run_layout(layout: str, rank: int, env: dict) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    from muond.torch import Muon, QKClip, reduce_max_logits
    kw = dict(MUON_KW, fp32_matmul_prec="highest", ns_batch_size=1, rpc_timeout=30,
              wait_healthy_timeout=30)
    shards = None
    if layout == "megatron":
        params, shards = _megatron_params(rank)
        kw.update(daemons=[env["daemon"]], job_id=env["job_id"], shard_mode="local",
                  gtp_size=WORLD, g=rank)
    else:
        model = Net()
        if layout == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",)))
        params = dict(model.named_parameters())
    opt = Muon(list(params.items()), qk_clip=QKClip(layers(params), threshold=TAU), **kw)
    try:
        for step in range(1, STEPS + 1):
            for name, p in params.items():
                full = full_grad(name, step)
                if isinstance(p, DTensor):
                    p.grad = distribute_tensor(full, p.device_mesh, p.placements,
                                               src_data_rank=None)
                else:
                    p.grad = _shard(full, shards[name], rank) if shards else full
            opt.step(qk_max_logits=reduce_max_logits(rank_maxima(step, rank)))
    finally:
        opt.close()
    if shards is None:
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in params.items()}
    every = [None] * WORLD
    dist.all_gather_object(every, {n: p.detach().clone() for n, p in params.items()})
    return {n: _unshard([e[n] for e in every], shards[n]) for n in params}


def rank_main(rank: int, env: dict, layouts, results) -> None:
    """One trainer process of a WORLD-rank gloo job on this rank's daemon."""
    import torch.distributed as dist
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "MUOND_DAEMON": env["daemons"][rank], "MUOND_JOB_ID": env["job_id"],
                       "MUOND_TOKEN_FILE": env["token_file"]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{env['tmp']}/pg", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        for layout in layouts:
            try:
                full = run_layout(layout, rank, {**env, "daemon": env["daemons"][rank]})
                # numpy arrays travel by value (a tensor would by a shared fd).
                out = {"params": {n: v.numpy().copy() for n, v in full.items()}}
            except BaseException as e:  # reported to the test, naming the rank
                out = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
            results.put((layout, rank, out))
            dist.barrier()
    finally:
        dist.destroy_process_group()
