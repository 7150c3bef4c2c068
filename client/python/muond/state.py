"""muond.torch.Muon's optimizer state in torch.optim's format, and back.

The daemons hold the state as entries of their local shards (proto StateChunk):
``"<param>.momentum"`` (Muon), ``"<param>.variance_neuron"`` (NorMuon: one
value per row of the shard), ``"<param>.moment2"`` (AdaMuon: the shard's shape),
``"<param>.exp_avg"``, ``"<param>.exp_avg_sq"`` (AdamW; fp32, row-major) and
``"<param>.step"`` (an AdamW param's step count). torch.optim keys it by param
with whole tensors: Muon ``{"momentum_buffer"}``, NorMuon also
``"variance_neuron"`` of shape ``[..., rows, 1]`` (dion's: the param's shape
with its last dim 1), AdaMuon also ``"moment2_buffer"`` of the param's shape
(Emerging-Optimizers'), AdamW ``{"step": float32 scalar, "exp_avg",
"exp_avg_sq"}``. This module is the one place that converts between the two and
checks a state dict before any of it reaches a daemon:

* ``assemble``: every daemon's entries -> one ``{key: tensor}`` per param, of the
  param's full shape (split mode: each shard is a strided view of one buffer
  laid out as muond.split says, the model's tensor its contiguous prefix; solo
  and local mode: the whole entry; a batched param (muond.batched): each
  matrix's entry at its offset).
* ``validate``: a loaded state dict's per-param state -> fp32 CPU tensors, or a
  ValueError naming the param and the rule (nothing sent yet).
* ``disassemble``: per-param state -> each daemon's entries (split pad rows are
  zeros: their gradient rows are zero, so the daemons' state there is zero).

DTensor params (FSDP2, DTensor TP, HSDP, FSDP + TP): the daemons hold the
param's *local shard* (``ParamInfo.shape`` is its local shape) and torch.optim's
state is a DTensor with the param's mesh and placements (``ParamInfo.dist``),
built by ``DTensor.from_local`` with the global shape and stride given (FSDP2's
shards may be uneven, or empty), so torch.distributed.checkpoint saves and
reshards it as it does torch.optim's own state. ``validate`` takes a DTensor
(its local shard, redistributed first when its placements differ) or a plain
tensor of the param's global shape (sliced to the local shard, no
communication); the AdamW ``step`` stays a plain scalar, as torch's. NorMuon's
``variance_neuron`` is a DTensor of the param's mesh whose placements follow
the param's rows: a shard of the rows stays (FSDP2, column-parallel TP), a
shard of the columns (row-parallel TP) is Replicate, every rank holding the
whole rows' values.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from muond import batched as _batched
from muond import split as _split
from muond._dtensor import is_dtensor

# torch.optim's state keys per algorithm (a Muon param: per variant,
# ParamInfo.kind) -> the daemons' entry suffix.
TORCH_KEYS = {
    "muon": {"momentum_buffer": "momentum"},
    "normuon": {"momentum_buffer": "momentum", "variance_neuron": "variance_neuron"},
    "adamuon": {"momentum_buffer": "momentum", "moment2_buffer": "moment2"},
    "adamw": {"step": "step", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
# State with one value per row of the param: shape [..., rows, 1].
ROW_KEYS = ("variance_neuron",)
# The variants' second moments: never negative (the daemon refuses them too).
SECOND_MOMENTS = ("variance_neuron", "moment2_buffer")
# The step id key kept in every param group of a state dict:
# torch.distributed.checkpoint keeps only "state" and "param_groups" (and the
# keys inside them), so a top-level key would be lost on that path.
STEP_ID_KEY = "muond_step_id"
# The layout of a param without elements: no daemon holds it (muond.torch.layouts).
EMPTY = "empty"


@dataclass(frozen=True)
class DistSpec:
    """A DTensor param's distribution: torch.optim's state of it is a DTensor
    of this mesh, placements, global shape and stride."""
    mesh: object
    placements: tuple
    shape: tuple
    stride: tuple


def dist_spec(p) -> DistSpec | None:
    """The DistSpec of a DTensor param, None for a plain tensor."""
    if not is_dtensor(p):
        return None
    return DistSpec(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()))


def local_shape(p) -> tuple:
    """The shape the daemons hold of param ``p``: a DTensor's local shard's."""
    return tuple(p._local_tensor.shape if is_dtensor(p) else p.shape)


@dataclass(frozen=True)
class ParamInfo:
    """Where one param's state lives: ``layout`` is a muond.split.SplitLayout,
    ("solo", rank), "local" (rank 0), a muond.batched.BatchLayout (a Muon param of
    more than two dims: one entry per matrix) or EMPTY (none), as
    muond.torch.Muon.layouts; ``shape``
    the shape the daemons hold (a DTensor param's local shard's), ``dist`` the
    DTensor param's distribution (None for a plain param), ``variant`` a Muon
    param's ("muon", "normuon", "adamuon")."""
    name: str
    algorithm: str      # "muon" | "adamw"
    shape: tuple
    layout: object
    dist: DistSpec | None = None
    variant: str = "muon"

    @property
    def kind(self) -> str:
        """The TORCH_KEYS entry: the algorithm, a Muon param's variant."""
        return self.variant if self.algorithm == "muon" else self.algorithm

    def keys(self) -> dict:
        return TORCH_KEYS[self.kind]

    def ranks(self) -> list[int]:
        if self.layout == EMPTY:
            return []
        if isinstance(self.layout, _split.SplitLayout):
            return [s.rank for s in self.layout.shards]
        if isinstance(self.layout, _batched.BatchLayout):
            return self.layout.ranks()
        if isinstance(self.layout, tuple):
            return [self.layout[1]]
        return [0]


def param_info(name: str, group: dict, p, layout) -> ParamInfo:
    """The ParamInfo of param ``p`` of param group ``group``."""
    algorithm = group["algorithm"]
    variant = group.get("variant", "muon") if algorithm == "muon" else "muon"
    return ParamInfo(name, algorithm, local_shape(p), layout, dist_spec(p), variant)


def _row_dist(dist: DistSpec | None) -> DistSpec | None:
    """The distribution of a row vector of a DTensor param: its placements
    with a shard of the last dim (the columns) Replicate."""
    if dist is None:
        return None
    from torch.distributed.tensor import Replicate
    n = len(dist.shape)
    placements = tuple(Replicate() if p.is_shard() and p.dim in (n - 1, -1) else p
                       for p in dist.placements)
    shape = tuple(dist.shape[:-1]) + (1,)
    stride, acc = [], 1
    for size in reversed(shape):
        stride.insert(0, acc)
        acc *= int(size)
    return DistSpec(dist.mesh, placements, shape, tuple(stride))


def key_info(info: ParamInfo, key: str | None) -> ParamInfo:
    """``info`` as the state tensor ``key`` is laid out: a row key's shape is
    the param's (local) shape with its last dim 1, its distribution _row_dist."""
    if key not in ROW_KEYS:
        return info
    return replace(info, shape=tuple(info.shape[:-1]) + (1,), dist=_row_dist(info.dist))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _entry(entries: dict, key: str, numel: int, rank: int) -> torch.Tensor:
    if key not in entries:
        raise RuntimeError(f"muond daemon rank {rank} exported no state entry {key!r}")
    value = entries[key]
    value = (value if isinstance(value, torch.Tensor)
             else torch.tensor(list(value), dtype=torch.float32))
    value = value.detach().to("cpu", torch.float32).reshape(-1)
    if value.numel() != numel:
        raise RuntimeError(f"muond daemon rank {rank}: state entry {key!r} has {value.numel()} "
                           f"values, expected {numel}")
    return value


def _runs(info: ParamInfo, rows: bool):
    """Each matrix of a batched param: (matrix, offset, numel) of its run in
    the param's local state tensor, flat: its elements, or (``rows``) one
    value per row of it."""
    cols, at = int(info.shape[-1]), 0
    for m in info.layout.matrices:
        n = int(m.shape[0]) if rows else m.numel
        offset = (m.offset // cols if cols else at) if rows else m.offset
        at = offset + n
        yield m, offset, n


def _assemble_batch(info: ParamInfo, suffix: str, per_rank: dict, rows: bool) -> torch.Tensor:
    """A batched param's state: each matrix's entry at its offset in the
    param's local tensor (contiguous, so a matrix is one run of elements)."""
    shape = key_info(info, ROW_KEYS[0] if rows else None).shape
    flat = torch.zeros(_numel(shape), dtype=torch.float32)
    for m, offset, n in _runs(info, rows):
        rank = m.rank
        flat[offset:offset + n].copy_(_entry(per_rank[rank], f"{m.name}.{suffix}", n, rank))
    if not info.layout.perm:
        return flat.view(shape)
    out = torch.zeros(shape, dtype=torch.float32)
    out[list(info.layout.perm)] = flat.view(shape)
    return out


def _assemble_tensor(info: ParamInfo, suffix: str, per_rank: dict,
                     rows: bool = False) -> torch.Tensor:
    key = f"{info.name}.{suffix}"
    layout = info.layout
    if isinstance(layout, _batched.BatchLayout):
        return _assemble_batch(info, suffix, per_rank, rows)
    shape = key_info(info, ROW_KEYS[0] if rows else None).shape
    if not isinstance(layout, _split.SplitLayout):
        rank = info.ranks()[0]
        return _entry(per_rank[rank], key, _numel(shape), rank).view(shape).clone()
    if rows:  # a shard's rows start at its offset's row; TP column blocks share them
        cols = layout.full_shape[1]
        vector = torch.zeros(layout.buffer_rows, dtype=torch.float32)
        for s in sorted(layout.shards, key=lambda s: -s.t):  # t = 0's values last
            start = s.offset // cols
            vector[start:start + s.shape[0]] = _entry(per_rank[s.rank], key, s.shape[0],
                                                      s.rank)
        return vector[:shape[0]].view(shape).clone()
    buffer = torch.zeros(layout.buffer_numel, dtype=torch.float32)
    for s in layout.shards:
        value = _entry(per_rank[s.rank], key, s.shape[0] * s.shape[1], s.rank)
        buffer.as_strided(s.shape, s.strides, s.offset).copy_(value.view(s.shape))
    return buffer[:_numel(info.shape)].view(info.shape).clone()


def assemble(infos: list[ParamInfo], per_rank: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Param name -> torch.optim's state of that param, from ``per_rank``
    (rank -> {entry name: values}, as Client.export_state returns them)."""
    out = {}
    for info in infos:
        state = {}
        if info.layout == EMPTY:  # no daemon holds it: its (empty) state at zero
            out[info.name] = zero_state(info)
            continue
        for key, suffix in info.keys().items():
            if key == "step":
                rank = info.ranks()[0]
                state[key] = _entry(per_rank[rank], f"{info.name}.step", 1, rank)[0].clone()
            else:
                state[key] = _assemble_tensor(info, suffix, per_rank, key in ROW_KEYS)
        out[info.name] = state
    return out


def as_dtensor(info: ParamInfo, local: torch.Tensor, key: str | None = None):
    """``local`` (state tensor ``key`` of the param's local shard, on the
    param's device) as torch.optim hands it out: a DTensor of the param's
    distribution (a row key's: key_info) for a DTensor param (no
    communication), else as is."""
    info = key_info(info, key)
    if info.dist is None:
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, info.dist.mesh, info.dist.placements, run_check=False,
                              shape=torch.Size(info.dist.shape), stride=info.dist.stride)


def local_of(value):
    """The tensor whose ``_version`` an in-place edit of ``value`` bumps (a
    DTensor's local shard)."""
    return value._local_tensor if is_dtensor(value) else value


def _local_shard(info: ParamInfo, key: str, value):
    """A DTensor param's state value as its local shard: a DTensor of the
    param's mesh (redistributed to the param's placements when they differ:
    every rank loads together), or a plain tensor of the param's global shape
    (sliced here as the param is sharded, no communication). ValueError
    naming the param otherwise."""
    dist = info.dist
    global_shape = tuple(value.shape)
    if global_shape != dist.shape:
        raise ValueError(f"param {info.name}: state[{key!r}] has global shape {global_shape}, "
                         f"the param's is {dist.shape}")
    if is_dtensor(value):
        if value.device_mesh != dist.mesh:
            raise ValueError(f"param {info.name}: state[{key!r}] is a DTensor on mesh "
                             f"{value.device_mesh}, the param's is {dist.mesh} (load it "
                             "through torch.distributed.checkpoint, which reshards)")
        if tuple(value.placements) != dist.placements:
            value = value.redistribute(dist.mesh, dist.placements)
        local = value.to_local()
    else:
        from torch.distributed.tensor import distribute_tensor
        local = distribute_tensor(value.detach(), dist.mesh, dist.placements,
                                  src_data_rank=None).to_local()
    if tuple(local.shape) != tuple(info.shape):
        raise ValueError(f"param {info.name}: state[{key!r}]'s local shard has shape "
                         f"{tuple(local.shape)}, the param's local shard {tuple(info.shape)}")
    return local


def _finite(value) -> bool:
    """True when the tensor ``value`` as given (a DTensor's local shard) holds
    no NaN or Inf (so a non-finite fp32 copy overflowed)."""
    local = local_of(value)
    return isinstance(local, torch.Tensor) and bool(torch.isfinite(local).all())


def _fp32(info: ParamInfo, key: str, value) -> torch.Tensor:
    info = key_info(info, key)
    if info.dist is not None and key != "step" and isinstance(value, torch.Tensor):
        value = _local_shard(info, key, value)
    elif is_dtensor(value):  # a replicated scalar (step): every rank's value
        value = value.to_local()
    if not isinstance(value, torch.Tensor):
        if key == "step" and isinstance(value, (int, float)):
            return torch.tensor(float(value), dtype=torch.float32)
        raise ValueError(f"param {info.name}: state[{key!r}] must be a tensor, got "
                         f"{type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"param {info.name}: state[{key!r}] is on the meta device (no "
                         "values): load a state dict with real tensors")
    if not value.is_floating_point() and not (key == "step" and value.dtype in
                                              (torch.int32, torch.int64)):
        raise ValueError(f"param {info.name}: state[{key!r}] must be a floating tensor, got "
                         f"{value.dtype}")
    return value.detach().to("cpu", torch.float32)


def zero_state(info: ParamInfo, keys=None) -> dict[str, torch.Tensor]:
    """The param's state before its first step (``keys`` of it, default all):
    fp32 zeros of each key's shape, step 0."""
    return {key: torch.zeros((), dtype=torch.float32) if key == "step"
            else torch.zeros(key_info(info, key).shape, dtype=torch.float32)
            for key in (info.keys() if keys is None else keys)}


def validate(infos: list[ParamInfo], states: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Param name -> its state as fp32 CPU tensors, from ``states`` (param name
    -> torch.optim state dict of that param; a param without one starts from
    zero, as torch.optim's lazy state does). Raises ValueError naming the param
    and the rule on unknown or missing keys, wrong shapes, non-finite values."""
    out = {}
    for info in infos:
        keys, kind = info.keys(), info.kind
        given = dict(states.get(info.name) or {})
        unknown = sorted(set(given) - set(keys))
        if unknown:
            hint = ("; a checkpoint of another Muon variant: drop those keys from each "
                    "param's state to go on with this one" if set(unknown) <= set(SECOND_MOMENTS)
                    else "")
            raise ValueError(f"param {info.name}: state keys {unknown} are not {kind}'s "
                             f"(expected {sorted(keys)}){hint}")
        missing = set(keys) - set(given)
        if given and missing - set(SECOND_MOMENTS):
            raise ValueError(f"param {info.name}: state has keys {sorted(given)}, "
                             f"{kind} needs all of {sorted(keys)}")
        # A variant's second moment missing (a Muon or torch.optim.Muon
        # checkpoint moving to NorMuon/AdaMuon) starts from zero, as dion's.
        state = {}
        for key in keys:
            if key not in given:
                state.update(zero_state(info, [key]))
                continue
            value = _fp32(info, key, given[key])
            want = () if key == "step" else tuple(key_info(info, key).shape)
            if key == "step" and value.numel() == 1:
                value = value.reshape(())
            if tuple(value.shape) != want:
                raise ValueError(f"param {info.name}: state[{key!r}] has shape "
                                 f"{tuple(value.shape)}, the param needs {want}")
            if not torch.isfinite(value).all():
                if _finite(given[key]):
                    raise ValueError(
                        f"param {info.name}: state[{key!r}] has values beyond fp32's range "
                        f"(|x| up to {float(local_of(given[key]).abs().max()):g}); a state "
                        "dict travels in fp32 (and bf16 state holds less: the daemons refuse "
                        "what would round to inf there)")
                raise ValueError(f"param {info.name}: state[{key!r}] has non-finite values")
            if key in SECOND_MOMENTS and (value < 0).any():
                raise ValueError(f"param {info.name}: state[{key!r}] has negative values "
                                 f"(min {value.min().item()}); a second moment is >= 0")
            if key == "step" and (value < 0 or value != value.round()):
                raise ValueError(f"param {info.name}: state['step'] must be a whole number >= "
                                 f"0, got {value.item()}")
            state[key] = value
        out[info.name] = state
    return out


def disassemble(infos: list[ParamInfo], states: dict, world: int) -> list[dict]:
    """Each daemon's entries (rank -> {entry: fp32 1-D tensor}) of ``states``
    (validate's result)."""
    per_rank = [dict() for _ in range(world)]
    for info in infos:
        if info.layout == EMPTY:
            continue
        state = states[info.name]
        for key, suffix in info.keys().items():
            name = f"{info.name}.{suffix}"
            value = state[key]
            if key == "step":
                per_rank[info.ranks()[0]][name] = value.reshape(1).clone()
                continue
            layout = info.layout
            if isinstance(layout, _batched.BatchLayout):
                flat = (value[list(layout.perm)] if layout.perm else value).reshape(-1)
                for m, offset, n in _runs(info, key in ROW_KEYS):
                    per_rank[m.rank][f"{m.name}.{suffix}"] = (
                        flat[offset:offset + n].clone())
                continue
            if not isinstance(layout, _split.SplitLayout):
                per_rank[info.ranks()[0]][name] = value.reshape(-1).clone()
                continue
            if key in ROW_KEYS:  # each shard: its rows' values (zeros for pad rows)
                vector = torch.zeros(layout.buffer_rows, dtype=torch.float32)
                vector[:value.numel()].copy_(value.reshape(-1))
                for s in layout.shards:
                    start = s.offset // layout.full_shape[1]
                    per_rank[s.rank][name] = vector[start:start + s.shape[0]].clone()
                continue
            buffer = torch.zeros(layout.buffer_numel, dtype=torch.float32)
            buffer[:value.numel()].copy_(value.reshape(-1))
            for s in layout.shards:
                per_rank[s.rank][name] = (buffer.as_strided(s.shape, s.strides, s.offset)
                                          .contiguous().reshape(-1))
    return per_rank
