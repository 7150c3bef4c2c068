"""The trainer side of test_layouts: N trainer processes (gloo on CPU), spawned
once, each driving its rank's daemon; the test sends every process the name of
a layout (``run``), each process builds that layout's model, a new
muond.torch.Muon, steps it on the same full gradients, closes it and answers
with what the test compares.

Models are a few bias-free Linear layers (``SPECS``): their full initial
values and the full gradient of every step come from fixed seeds
(``full_init`` / ``full_grad``), so every layout (and the single-process
reference in the test) sees the same full model and the same full gradients;
each rank sets its params' grads to its shard of the full gradient (a DTensor
of the param's placements, or the Megatron local shard).
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import traceback

import torch

STEPS = 3
# Bitwise against the single-daemon reference: NS in fp32, one matrix a batch.
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
               fp32_matmul_prec="highest", ns_batch_size=1)
# name -> {linear name: (out rows P, in columns Q)} (the weight is P x Q).
SPECS = {
    # Divides by 4 and by 2 x 2 on every dim a layout shards.
    "even": {"up": (32, 16), "down": (16, 32)},
    # FSDP2 over 4 ranks: torch.chunk rows 10+10+10+8, and 1+1+1+0 (an empty shard).
    "uneven": {"up": (38, 16), "down": (16, 24), "tiny": (3, 16)},
    # DDP over 4 ranks: 8 equal matrices, so the plan's NS homes give each
    # rank exactly 2 (1/4 of the job's ns_cost).
    "ddp": {f"l{i}": (16, 24) for i in range(8)},
    # Megatron tags on G x T = 2 x 2: up column-parallel, down row-parallel with
    # one GTP pad row (15 rows over G = 2).
    "megatron": {"up": (32, 16), "down": (15, 32)},
    # FSDP2 x TP where "mid" is outside the TP plan: FSDP2 puts it on mesh["dp"]
    # (replicated over tp), a DP axis of its domain on the root mesh.
    "mixed": {"up": (32, 16), "down": (16, 32), "mid": (16, 24)},
    # A batch of 6 expert matrices as one [E, m, n] param beside a 2-D one:
    # FSDP2's Shard(0) over 4 ranks gives 2 + 2 + 2 + 0 experts (a rank with
    # none), Shard(1) 10 rows of every expert (FSDP2 shards dims other than 0
    # only evenly).
    "experts": {"experts": (6, 40, 16), "router": (16, 24)},
    # A fused QKV weight in Megatron's layout: 6 query groups of 6 query, 3
    # key and 3 value rows (72 rows). FSDP2 over 4 ranks cuts it into 18-row
    # chunks, across the groups; TP over 2 gives each rank 3 whole groups.
    "qkv": {"qkv": (72, 16), "out": (16, 24)},
    "qkv_heads": {"qkv": (72, 16), "out": (16, 24)},
}
# How the QKV specs split their fused weight (split_qkv's qkv_split_shapes;
# qkv_head_dim: every head of 3 rows apart).
QKV_SHAPES = (6, 3, 3)
QKV_SPLIT = {"qkv": dict(split_qkv=True, qkv_split_shapes=list(QKV_SHAPES)),
             "qkv_heads": dict(split_qkv=True, qkv_split_shapes=list(QKV_SHAPES),
                               qkv_head_dim=3)}


def variant_kw(variant: str) -> dict:
    """A Muon variant's options ("" or "muon": none)."""
    return dict(variant=variant, beta2=0.9) if variant and variant != "muon" else {}


def is_qkv(p) -> bool:
    return getattr(p, "is_qkv", False)


def muon_kw(spec: str) -> dict:
    """MUON_KW and the spec's QKV split options."""
    split = QKV_SPLIT.get(spec)
    return {**MUON_KW, **(dict(split, is_qkv_fn=is_qkv) if split else {})}


def qkv_parts(spec: str, t: torch.Tensor) -> list:
    """The matrices split_qkv orthogonalises apart, written from the seed's
    rule: the rows viewed as (groups, q + k + v, -1), split along dim 1, each
    part reshaped to (-1, cols); per head, each head's rows of each group."""
    cols = t.shape[1]
    grouped = t.view(-1, sum(QKV_SHAPES), cols)
    parts = torch.split(grouped, list(QKV_SHAPES), dim=1)
    d = QKV_SPLIT[spec].get("qkv_head_dim")
    if d is None:
        return [p.reshape(-1, cols) for p in parts]
    return [h for g in range(grouped.shape[0]) for p in parts for h in torch.split(p[g], d)]


def qkv_whole(spec: str, parts: list, like: torch.Tensor) -> torch.Tensor:
    """qkv_parts inverted."""
    cols = like.shape[1]
    groups = like.shape[0] // sum(QKV_SHAPES)
    d = QKV_SPLIT[spec].get("qkv_head_dim")
    if d is None:
        return torch.cat([p.reshape(groups, -1, cols) for p in parts], dim=1).reshape(like.shape)
    return torch.cat(parts).reshape(like.shape)
WORLD = 4


def full_init(spec: str) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(sorted(SPECS[spec].items())):
        g = torch.Generator().manual_seed(17 + i)
        out[f"{name}.weight"] = torch.randn(shape, generator=g) * 0.3
    return out


def full_grad(spec: str, name: str, step: int) -> torch.Tensor:
    names = sorted(f"{n}.weight" for n in SPECS[spec])
    g = torch.Generator().manual_seed(1000 * step + names.index(name))
    shape = SPECS[spec][name.split(".")[0]]
    return torch.randn(shape, generator=g)


class Net(torch.nn.Module):
    def __init__(self, spec: str):
        super().__init__()
        self.spec = spec
        init = full_init(spec)
        for name, shape in SPECS[spec].items():
            if len(shape) == 2:
                layer = torch.nn.Linear(shape[1], shape[0], bias=False)
            else:  # a batch of matrices (experts) as one param
                layer = torch.nn.Module()
                layer.weight = torch.nn.Parameter(torch.empty(shape))
            with torch.no_grad():
                layer.weight.copy_(init[f"{name}.weight"])
            setattr(self, name, layer)


def _dtensor():
    from torch.distributed import tensor
    return tensor


def _is_dtensor(t) -> bool:
    return isinstance(t, _dtensor().DTensor)


def shard_of(full: torch.Tensor, like):
    """``full``'s shard as ``like`` (a DTensor param) holds it: a DTensor of the
    same placements (local slicing, no communication)."""
    return _dtensor().distribute_tensor(full, like.device_mesh, like.placements,
                                        src_data_rank=None)


# -- the layouts -----------------------------------------------------------------
def _mesh(shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def build(layout: str) -> tuple[str, torch.nn.Module]:
    """(spec, model) of a DTensor or DDP layout on the WORLD ranks."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    if layout == "ddp":  # plain params: every rank a replica (D = 4)
        return "ddp", torch.nn.parallel.DistributedDataParallel(Net("ddp"))
    if layout in ("fsdp_even", "fsdp_uneven"):
        spec = layout.split("_")[1]
        model = Net(spec)
        fully_shard(model, mesh=_mesh((WORLD,), ("fsdp",)))
        return spec, model
    if layout == "tp":
        model = Net("even")
        parallelize_module(model, _mesh((WORLD,), ("tp",)), _tp_plan())
        return "even", model
    if layout == "fsdp_tp":
        mesh = _mesh((2, 2), ("dp", "tp"))
        model = Net("even")
        parallelize_module(model, mesh["tp"], _tp_plan())
        fully_shard(model, mesh=mesh["dp"])
        return "even", model
    if layout == "fsdp_tp_mixed":
        mesh = _mesh((2, 2), ("dp", "tp"))
        model = Net("mixed")
        parallelize_module(model, mesh["tp"], _tp_plan())
        fully_shard(model, mesh=mesh["dp"])
        return "mixed", model
    if layout in ("experts_fsdp", "experts_fsdp_rows"):
        from torch.distributed.tensor import Shard
        model = Net("experts")
        rows = layout.endswith("rows")  # Shard(1): every expert's rows, not whole experts
        fully_shard(model, mesh=_mesh((WORLD,), ("fsdp",)),
                    shard_placement_fn=lambda p: Shard(1) if rows and p.ndim == 3 else None)
        return "experts", model
    if layout == "experts_ddp":
        return "experts", torch.nn.parallel.DistributedDataParallel(Net("experts"))
    if layout == "experts_ep_tp":
        return "experts", _experts_ep_tp()
    if layout in ("qkv_fsdp", "qkv_heads_fsdp"):
        spec = layout.removesuffix("_fsdp")
        model = Net(spec)
        fully_shard(model, mesh=_mesh((WORLD,), ("fsdp",)))
        model.qkv.weight.is_qkv = True
        return spec, model
    if layout == "qkv_fsdp_tp":
        mesh = _mesh((2, 2), ("dp", "tp"))
        model = Net("qkv")
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        parallelize_module(model, mesh["tp"], {"qkv": ColwiseParallel(),
                                               "out": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        model.qkv.weight.is_qkv = True
        return "qkv", model
    if layout == "qkv_ddp":
        model = Net("qkv")
        model.qkv.weight.is_qkv = True
        return "qkv", torch.nn.parallel.DistributedDataParallel(model)
    if layout == "hsdp":
        model = Net("even")
        fully_shard(model, mesh=_mesh((2, 2), ("replicate", "shard")))
        return "even", model
    raise ValueError(f"unknown layout {layout!r}")


def _experts_ep_tp():
    """Experts over "ep" (3 of the 6 on each ep coordinate),
    each expert's rows column-parallel over "tp", the router TP-replicated
    and FSDP-like row-sharded over "ep"."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = _mesh((2, 2), ("ep", "tp"))
    model = Net("experts")
    for name, placements in (("experts", (Shard(0), Shard(1))),
                             ("router", (Shard(0), Replicate()))):
        layer = getattr(model, name)
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh,
                                                            placements, src_data_rank=None))
    return model


def set_grads(model, spec: str, step: int) -> None:
    for name, p in model.named_parameters():
        full = full_grad(spec, name.removeprefix("module."), step)
        p.grad = shard_of(full, p) if _is_dtensor(p) else full


def full_params(model) -> dict[str, torch.Tensor]:
    """Every param's full value (collective for DTensors: call on every rank)."""
    return {n: (p.full_tensor() if _is_dtensor(p) else p).detach().clone()
            for n, p in model.named_parameters()}


def train(model, opt, spec: str, first: int, last: int) -> None:
    for step in range(first, last + 1):
        set_grads(model, spec, step)
        opt.step()


# -- Megatron-tagged local shards (muond.split's shard rule, G x T = 2 x 2) -------
MEGATRON_TP_DIM = {"up": 0, "down": 1, "qkv": 0, "out": 1}


def megatron_layouts(spec: str = "megatron"):
    from muond import split
    return {f"{n}.weight": split.plan_split(shape, 2, 2, MEGATRON_TP_DIM[n])
            for n, shape in SPECS[spec].items()}


def megatron_shard(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    buffer = torch.zeros(layout.buffer_numel)
    buffer[:full.numel()].copy_(full.reshape(-1))
    s = layout.shards[rank]
    return buffer.as_strided(s.shape, s.strides, s.offset).clone()


def megatron_full(shards: list, layout) -> torch.Tensor:
    buffer = torch.zeros(layout.buffer_numel)
    for s, value in zip(layout.shards, shards):
        buffer.as_strided(s.shape, s.strides, s.offset).copy_(value)
    return buffer[:layout.full_shape[0] * layout.full_shape[1]].view(layout.full_shape).clone()


def megatron_params(rank: int, mismatch: bool = False, spec: str = "megatron"):
    """This rank's tagged local shards; ``mismatch``: rank 3's "up" one row short."""
    out = []
    for name, layout in megatron_layouts(spec).items():
        local = megatron_shard(full_init(spec)[name], layout, rank)
        if mismatch and rank == WORLD - 1 and name == "up.weight":
            local = local[:-1].clone()
        p = torch.nn.Parameter(local)
        p.tensor_model_parallel, p.partition_dim = True, layout.tp_dim
        p.is_gtp_weight_remat, p.pad_length = True, layout.pad_length
        p.full_shape = list(layout.full_shape)
        p.is_qkv = name == "qkv.weight"  # as Megatron's optimizer setup tags linear_qkv
        out.append((name, p))
    return out


# -- the process side --------------------------------------------------------------
class Worker:
    def __init__(self, rank: int, env: dict):
        self.rank, self.env = rank, env

    def run(self, layout: str) -> dict:
        """``layout``, or ``layout@variant``: the same with Muon(variant=...)."""
        import torch.distributed as dist
        t0 = time.monotonic()
        layout, _, variant = layout.partition("@")
        self.variant_kw = variant_kw(variant)
        try:
            result = getattr(self, f"run_{layout}", None)
            result = result() if result else self.run_dtensor(layout)
            result["ok"] = True
        except BaseException as e:  # reported to the test, which fails naming the rank
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()}
        result["seconds"] = time.monotonic() - t0
        result["rank"] = self.rank
        dist.barrier()
        return result

    def _opt(self, params, **kw):
        from muond.torch import Muon
        kw.setdefault("rpc_timeout", 30)
        kw.setdefault("wait_healthy_timeout", 30)
        return Muon(params, **{**MUON_KW, **getattr(self, "variant_kw", {}), **kw})

    def _plan(self, opt):
        """The coordinator's plan of ``opt``'s optimizer instance (rank 0
        asks; None elsewhere). Each optimizer a process makes after its
        first is its own instance, whose job is "<job_id>/<name>"."""
        if self.rank != 0:
            return None
        import grpc
        from muond.v1 import muond_pb2 as pb
        from muond.v1 import muond_pb2_grpc as pb_grpc
        job = self.env["job_id"] + (f"/{opt.name}" if opt.name else "")
        with grpc.insecure_channel(self.env["coordinator"]) as channel:
            return pb_grpc.CoordinatorStub(channel).GetPlan(
                pb.GetPlanRequest(job_id=job), timeout=10,
                metadata=[("x-muond-token", self.env["token"])])

    def _plan_loads(self, opt) -> dict:
        """group -> the plan's rank_load (rank 0 only)."""
        plan = self._plan(opt)
        return {g.group: list(g.rank_load) for g in plan.groups} if plan else {}

    def _plan_home_rows(self, opt) -> dict:
        """group -> each param's NS home g, in manifest order (rank 0 only)."""
        plan = self._plan(opt)
        return {g.group: [h.g for h in g.homes] for g in plan.groups} if plan else {}

    def _plan_homes(self, opt) -> int:
        """How many NS homes the plan has in all (rank 0 only): one per Muon
        matrix when no matrix's NS runs twice."""
        plan = self._plan(opt)
        return sum(len(g.homes) for g in plan.groups) if plan else 0

    def run_dtensor(self, layout: str) -> dict:
        spec, model = build(layout)
        opt = self._one_muon_group(model)
        try:
            train(model, opt, spec, 1, STEPS)
            loads, homes = self._plan_loads(opt), self._plan_homes(opt)
            home_rows = self._plan_home_rows(opt)
        finally:
            opt.close()
        return {"spec": spec, "params": full_params(model), "loads": loads, "homes": homes,
                "home_rows": home_rows}

    def run_megatron(self, mismatch: bool = False, spec: str = "megatron") -> dict:
        import torch.distributed as dist
        params = megatron_params(self.rank, mismatch, spec)
        g, t = divmod(self.rank, 2)
        opt = self._opt(params, daemons=[self.env["daemon"]], job_id=self.env["job_id"],
                        shard_mode="local", gtp_size=2, tp_size=2, g=g, t=t, **muon_kw(spec))
        try:
            layouts = megatron_layouts(spec)
            for step in range(1, STEPS + 1):
                for name, p in params:
                    p.grad = megatron_shard(full_grad(spec, name, step), layouts[name],
                                            self.rank)
                opt.step()
            loads = self._plan_loads(opt)
        finally:
            opt.close()
        shards = [None] * WORLD
        dist.all_gather_object(shards, {n: p.detach().clone() for n, p in params})
        full = {n: megatron_full([s[n] for s in shards], layouts[n]) for n in layouts}
        return {"spec": spec, "params": full, "loads": loads}

    def run_megatron_qkv(self) -> dict:
        """Megatron-tagged shards (G x T = 2 x 2) of a fused QKV weight with
        split_qkv: TP by whole query groups, GTP blocks cutting them."""
        return self.run_megatron(spec="qkv")

    def run_ddp_mismatch(self) -> dict:
        """Plain params (DDP replicas), rank 3's "l0" one row short."""
        model = Net("ddp")
        if self.rank == WORLD - 1:
            model.l0 = torch.nn.Linear(24, 15, bias=False)
        opt = self._opt(list(model.named_parameters()))
        opt.close()
        return {}

    def run_megatron_mismatch(self) -> dict:
        return self.run_megatron(mismatch=True)

    def run_dcp_fsdp_to_fsdp_tp(self) -> dict:
        """FSDP2 trains 2 steps and saves (DCP); FSDP2 x TP loads and trains on."""
        return self._dcp_resume("fsdp_even", "fsdp_tp")

    def run_dcp_experts_fsdp_to_ep_tp(self) -> dict:
        """Experts whole per rank (FSDP2) save; experts over ep x rows over tp load."""
        return self._dcp_resume("experts_fsdp", "experts_ep_tp")

    def _one_muon_group(self, model):
        """A Muon of every param as one group, given explicitly: a plain
        params iterable puts params that are not 2-D (experts) in AdamW."""
        names, params = zip(*model.named_parameters())
        return self._opt([{"params": list(params), "param_names": list(names)}],
                         **muon_kw(getattr(getattr(model, "module", model), "spec", "")))

    def _dcp_resume(self, saved_on: str, resumed_on: str) -> dict:
        """``saved_on`` trains 2 steps and saves (DCP); ``resumed_on`` loads
        (DCP reshards the DTensor state) and trains on to STEPS + 1."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)
        path = os.path.join(self.env["tmp"], f"dcp-{saved_on}")
        spec, model = build(saved_on)
        opt = self._one_muon_group(model)
        try:
            train(model, opt, spec, 1, 2)
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        finally:
            opt.close()
        spec, model = build(resumed_on)
        opt = self._one_muon_group(model)
        try:
            state = {"model": get_model_state_dict(model),
                     "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            train(model, opt, spec, 3, STEPS + 1)
        finally:
            opt.close()
        return {"spec": spec, "params": full_params(model), "steps": STEPS + 1}

    def run_state_conversion(self) -> dict:
        """muond.state's DTensor side alone (no daemon): for FSDP2 uneven and
        FSDP2 x TP params, assembling a local-shard entry gives a DTensor whose
        full tensor is the full state, and validate takes it back, a plain
        full tensor and a DTensor of other placements to the same local shard."""
        from muond import state as mstate
        mismatches = []
        for layout in ("fsdp_uneven", "fsdp_tp"):
            spec, model = build(layout)
            for name, p in model.named_parameters():
                full = full_grad(spec, name, 99)
                local = shard_of(full, p).to_local()
                info = mstate.ParamInfo(name, "muon", mstate.local_shape(p), "local",
                                        mstate.dist_spec(p))
                state = mstate.assemble([info], {0: {f"{name}.momentum": local.reshape(-1)}})
                value = mstate.as_dtensor(info, state[name]["momentum_buffer"])
                if not _is_dtensor(value) or tuple(value.placements) != tuple(p.placements):
                    mismatches.append(f"{layout} {name}: state is {type(value).__name__} "
                                      f"{getattr(value, 'placements', None)}")
                    continue
                if not torch.equal(value.full_tensor(), full):
                    mismatches.append(f"{layout} {name}: full_tensor differs")
                replicated = _dtensor().distribute_tensor(
                    full, p.device_mesh, [_dtensor().Replicate()] * p.device_mesh.ndim,
                    src_data_rank=None)
                for kind, given in (("dtensor", value), ("full", full),
                                    ("replicated", replicated)):
                    got = mstate.validate([info], {name: {"momentum_buffer": given}})
                    if not torch.equal(got[name]["momentum_buffer"], local):
                        mismatches.append(f"{layout} {name}: validate({kind}) is not the "
                                          "local shard")
                try:
                    mstate.validate([info], {name: {"momentum_buffer": local + 0}})
                    if tuple(local.shape) != tuple(full.shape):
                        mismatches.append(f"{layout} {name}: a local-shaped plain tensor "
                                          "was taken as the full state")
                except ValueError as e:
                    if name not in str(e) or "global shape" not in str(e):
                        mismatches.append(f"{layout} {name}: refusal {e} names neither")
        return {"mismatches": mismatches}


def main(rank: int, env: dict, commands, results) -> None:
    """One trainer process: gloo world of WORLD, this rank's daemon; runs the
    layouts the test sends until it sends None."""
    import torch.distributed as dist
    # DTensor's "sequential all_gather" notes on _StridedShard redistribution.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                       "MUOND_DAEMON": env["daemons"][rank], "MUOND_JOB_ID": env["job_id"],
                       "MUOND_TOKEN_FILE": env["token_file"]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{env['tmp']}/pg", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    worker = Worker(rank, {**env, "daemon": env["daemons"][rank]})
    try:
        while True:
            layout = commands.get()
            if layout is None:
                break
            results.put(worker.run(layout))
    finally:
        dist.destroy_process_group()
