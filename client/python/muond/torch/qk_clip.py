"""QK-clip (MuonClip, Kimi K2): after a Muon step, the query and key weights
of every attention head whose largest pre-softmax logit over the step's batch
exceeded ``threshold`` are scaled down, in the trainer's param memory.

Per head h with maximum logit S_h (job-wide: the same on every rank):
gamma_h = threshold / max(S_h, threshold), in float32 (1 when S_h <= threshold,
also when S_h <= 0: no ``eta ** alpha`` of a negative eta). Then

* separate or fused (Megatron ``linear_qkv``) Q/K: the rows of query head h
  times gamma_h ** alpha; the rows of key head j times gamma_j ** (1 - alpha),
  where, as in Megatron-LM (GQA: several query heads share one key head),
  gamma_j = threshold / max(max of S over key head j's query heads, threshold).
  Value rows are untouched.
* MLA (``QKClipMLA``): per head the no-RoPE query rows times gamma_h ** alpha,
  the RoPE query rows times gamma_h, the no-RoPE key rows of ``wkv_b`` times
  gamma_h ** (1 - alpha); value rows and the shared RoPE key untouched.

Each rank scales the rows of its local shard (plain param, DDP replica,
split mode's full weight, Megatron-tagged shard, DTensor shard) by the factor
of the global row they hold, found from the param's place
(muond.torch.placement.ParamPlace): the result is the same elementwise
product on every layout. The factors are computed on the CPU in float32 from
the same maxima on every rank, so every layout is bitwise the single-process
result. ``prepare`` runs before any daemon is asked (a bad input changes
nothing); ``apply`` runs only after every daemon applied the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from muond._dtensor import is_dtensor
from muond.split import SplitLayout

# What a row of a Q/K weight is scaled by (an index into a layer's factor table).
_KEEP, _Q, _K, _QROPE = range(4)


@dataclass(frozen=True)
class QKClipAttention:
    """One multi-head (MHA) or grouped-query (GQA) attention layer: either
    ``q`` ([num_heads * head_dim, hidden]) and ``k`` ([num_kv_heads *
    head_dim, hidden]), or ``qkv``: Megatron's fused ``linear_qkv`` weight,
    rows [num_kv_heads, (num_heads / num_kv_heads + 2) * head_dim] (per query
    group its query heads, its key head, its value head). ``num_kv_heads``
    defaults to ``num_heads`` (MHA). ``name`` keys the layer's maxima in
    ``step(qk_max_logits=...)``."""
    name: str
    num_heads: int
    head_dim: int
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    qkv: torch.Tensor | None = None
    num_kv_heads: int | None = None

    def row_kinds(self) -> dict:
        """{"q"|"k"|"qkv": (param, [(kind, head)] per full row)}."""
        n, kv, d = self.num_heads, self.num_kv_heads or self.num_heads, self.head_dim
        per_group = n // kv
        if self.qkv is not None:
            rows = []
            for j in range(kv):
                rows += [(_Q, j * per_group + i // d) for i in range(per_group * d)]
                rows += [(_K, j)] * d + [(_KEEP, 0)] * d
            return {"qkv": (self.qkv, rows)}
        return {"q": (self.q, [(_Q, h) for h in range(n) for _ in range(d)]),
                "k": (self.k, [(_K, j) for j in range(kv) for _ in range(d)])}

    def check(self) -> None:
        _check_counts(self.name, num_heads=self.num_heads, head_dim=self.head_dim)
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        _check_counts(self.name, num_kv_heads=kv)
        if self.num_heads % kv:
            raise ValueError(f"qk_clip layer {self.name!r}: num_heads {self.num_heads} is not "
                             f"a multiple of num_kv_heads {kv}")
        fused, split = self.qkv is not None, (self.q is not None, self.k is not None)
        if fused == any(split) or (not fused and not all(split)):
            raise ValueError(f"qk_clip layer {self.name!r}: give q= and k= (separate "
                             "weights) or qkv= (Megatron's fused linear_qkv), not both or "
                             "neither")


@dataclass(frozen=True)
class QKClipMLA:
    """One multi-head latent attention layer (DeepSeek-V3 / Kimi K2): ``q``,
    the query up-projection (``wq`` or ``wq_b``, rows [num_heads,
    qk_nope_head_dim + qk_rope_head_dim]), and ``kv``, the key/value
    up-projection (``wkv_b``, rows [num_heads, qk_nope_head_dim +
    v_head_dim]). The shared RoPE key (part of ``wkv_a``) is not scaled."""
    name: str
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q: torch.Tensor
    kv: torch.Tensor

    def row_kinds(self) -> dict:
        nope, rope, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_rows, kv_rows = [], []
        for h in range(self.num_heads):
            q_rows += [(_Q, h)] * nope + [(_QROPE, h)] * rope
            kv_rows += [(_K, h)] * nope + [(_KEEP, 0)] * v
        return {"q": (self.q, q_rows), "kv": (self.kv, kv_rows)}

    def check(self) -> None:
        _check_counts(self.name, num_heads=self.num_heads, qk_nope_head_dim=self.qk_nope_head_dim,
                      v_head_dim=self.v_head_dim)
        _check_counts(self.name, minimum=0, qk_rope_head_dim=self.qk_rope_head_dim)
        if self.q is None or self.kv is None:
            raise ValueError(f"qk_clip layer {self.name!r}: QKClipMLA needs q= and kv=")

    @property
    def num_kv_heads(self) -> int:  # every head has its own no-RoPE key
        return self.num_heads


def _check_counts(layer: str, minimum: int = 1, **counts) -> None:
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"qk_clip layer {layer!r}: {key} must be an int >= {minimum}, "
                             f"got {value!r}")


@dataclass(frozen=True)
class QKClip:
    """``Muon(..., qk_clip=QKClip(layers, threshold=100.0, alpha=0.5))``:
    the attention layers to clip (QKClipAttention / QKClipMLA), tau
    (``threshold``, Megatron-LM's ``qk_clip_threshold``, > 0) and ``alpha``
    (``qk_clip_alpha``, in [0, 1]; the query's share of the scale)."""
    layers: tuple
    threshold: float = 100.0
    alpha: float = 0.5

    def check(self) -> None:
        for key, value, ok, rule in (
                ("threshold", self.threshold, lambda v: v > 0, "> 0"),
                ("alpha", self.alpha, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not ok(value)):
                raise ValueError(f"qk_clip {key} must be a finite number {rule}, got {value!r}")
        layers = list(self.layers)
        if not layers:
            raise ValueError("qk_clip needs at least one attention layer")
        names = set()
        for layer in layers:
            if not isinstance(layer, (QKClipAttention, QKClipMLA)):
                raise TypeError("qk_clip layers are QKClipAttention or QKClipMLA, not "
                                f"{type(layer).__name__}")
            if not isinstance(layer.name, str) or not layer.name:
                raise ValueError(f"qk_clip layer names must be non-empty str, got "
                                 f"{layer.name!r}")
            if layer.name in names:
                raise ValueError(f"qk_clip layer {layer.name!r} is listed twice")
            names.add(layer.name)
            layer.check()


@dataclass
class _Weight:
    """One Q/K weight of a layer: the param, its wire name, and per full
    row the factor-table index (0 keeps the row)."""
    layer: object
    role: str
    param: torch.Tensor
    name: str
    index: torch.Tensor  # int64 [full rows]
    # The factor-table index of each held row (0 for pad rows), for the
    # placement it was read from: it changes only when the params are placed
    # again (add_param_group).
    held: tuple = (None, None)

    def held_index(self, opt) -> torch.Tensor:
        """On the device of the param's held rows, read once per placement."""
        held = self.param.to_local() if is_dtensor(self.param) else self.param
        key = (id(opt.places.get(self.name)), id(opt.layouts.get(self.name)), held.device)
        if self.held[0] != key:
            rows, real = local_rows(opt, self.name, self.param)
            self.held = (key, torch.where(real, self.index[rows], 0).to(held.device))
        return self.held[1]


class Bound:
    """A QKClip checked against an optimizer's params."""

    def __init__(self, config: QKClip, weights: list[_Weight]):
        self.config, self.weights = config, weights
        self.layers = {layer.name: layer for layer in config.layers}


def bind(config: QKClip | None, opt) -> Bound | None:
    """``config`` checked against the registered params of ``opt`` (every
    q/k weight one of its Muon params, of the shape its layer gives), or
    ValueError naming the layer, the param and the expected shape."""
    if config is None:
        return None
    if not isinstance(config, QKClip):
        raise TypeError(f"qk_clip must be a muond.torch.QKClip, not {type(config).__name__}")
    config.check()
    algorithm = {id(p): g["algorithm"] for g in opt.param_groups for p in g["params"]}
    seen: dict[int, str] = {}
    weights = []
    for layer in config.layers:
        for role, (param, kinds) in layer.row_kinds().items():
            where = f"qk_clip layer {layer.name!r}: {role}"
            if not isinstance(param, torch.Tensor) or id(param) not in opt._param_names:
                raise ValueError(f"{where} is not a param of this optimizer")
            name = opt._param_names[id(param)]
            if algorithm[id(param)] != "muon":
                raise ValueError(f"{where} param {name} is in an AdamW group; QK-clip "
                                 "scales the Muon-stepped Q/K weights")
            if id(param) in seen:
                raise ValueError(f"{where} param {name} is also {seen[id(param)]}")
            seen[id(param)] = f"{layer.name}.{role}"
            rows = full_shape(opt, name, param)[0]
            if rows != len(kinds) or param.dim() != 2:
                raise ValueError(f"{where} param {name} has full shape "
                                 f"{tuple(full_shape(opt, name, param))}, expected "
                                 f"({len(kinds)}, hidden) ({_rows_rule(layer, role)})")
            _check_split_layout(opt, layer, role, name)
            index = torch.tensor([_table_index(layer, kind, head) for kind, head in kinds],
                                 dtype=torch.int64)
            weights.append(_Weight(layer, role, param, name, index))
    return Bound(config, weights)


def _check_split_layout(opt, layer, role: str, name: str) -> None:
    """A fused QKV weight that split_qkv also splits must have the layer's
    row layout in qkv_split_shapes (the same query groups), else ValueError."""
    choice = getattr(opt, "_qkv", None)
    split = choice.split if choice is not None else None
    if role != "qkv" or split is None or name not in opt._matrices:
        return
    kv = layer.num_kv_heads or layer.num_heads
    want = (layer.num_heads // kv * layer.head_dim, layer.head_dim, layer.head_dim)
    if tuple(split.shapes) != want:
        raise ValueError(f"qk_clip layer {layer.name!r}: qkv param {name} is split with "
                         f"qkv_split_shapes {list(split.shapes)}, but the layer's heads give "
                         f"{list(want)} rows of q, k, v per query group")


def _rows_rule(layer, role: str) -> str:
    if isinstance(layer, QKClipMLA):
        extra = layer.qk_rope_head_dim if role == "q" else layer.v_head_dim
        return (f"num_heads x ({'qk_nope_head_dim + ' + ('qk_rope' if role == 'q' else 'v')}"
                f"_head_dim) = {layer.num_heads} x ({layer.qk_nope_head_dim} + {extra})")
    kv = layer.num_kv_heads or layer.num_heads
    if role == "qkv":
        return (f"num_kv_heads x (num_heads / num_kv_heads + 2) x head_dim = {kv} x "
                f"({layer.num_heads // kv} + 2) x {layer.head_dim}")
    heads = layer.num_heads if role == "q" else kv
    return f"{'num_heads' if role == 'q' else 'num_kv_heads'} x head_dim = {heads} x " \
           f"{layer.head_dim}"


def _table_index(layer, kind: int, head: int) -> int:
    """Where a row's factor is in the layer's table [1, q (num_heads), k
    (num_kv_heads), q rope (num_heads)]."""
    n, kv = layer.num_heads, layer.num_kv_heads or layer.num_heads
    return {_KEEP: 0, _Q: 1 + head, _K: 1 + n + head, _QROPE: 1 + n + kv + head}[kind]


def full_shape(opt, name: str, param) -> tuple:
    place = opt.places.get(name)
    if place is not None:
        return tuple(place.full_shape)
    return tuple(param.shape)  # split mode: the trainer holds the full weight


def local_rows(opt, name: str, param) -> tuple[torch.Tensor, torch.Tensor]:
    """(global row of each local row, whether it is a real row: pad rows
    of a GTP shard are not) of the tensor this rank holds of ``param``."""
    held = param.to_local() if is_dtensor(param) else param
    n = int(held.shape[0])
    place = opt.places.get(name)
    layout = opt.layouts.get(name)
    if place is None or isinstance(layout, (SplitLayout, tuple)):
        # Split mode and solo params: the model's tensor is the full weight.
        return torch.arange(n), torch.ones(n, dtype=torch.bool)
    P = int(place.full_shape[0])
    tp_rows = place.tp_dim == 0 and place.T > 1
    Pt = P // place.T if tp_rows else P
    base = place.t * Pt if tp_rows else 0
    start = 0
    if place.gtp_sharded and place.G > 1:
        if place.gtp_rows:
            start = sum(int(r) for r in place.gtp_rows[:place.g])
        else:
            start = place.g * ((Pt + int(place.pad_length)) // place.G)
    tp_local = start + torch.arange(n)
    real = tp_local < Pt
    return base + torch.where(real, tp_local, 0), real


def factor_table(layer, maxima: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """[1, gamma_h ** alpha (num_heads), gamma_j ** (1 - alpha) (num_kv_heads),
    gamma_h (num_heads)] in float32 on the CPU (module docstring)."""
    tau = torch.tensor(threshold, dtype=torch.float32)
    s = maxima.to(torch.float32)
    gamma = tau / torch.maximum(s, tau)
    kv = layer.num_kv_heads or layer.num_heads
    key_max = s.view(kv, -1).amax(dim=1)  # a key head's query heads (Megatron's groups)
    gamma_k = tau / torch.maximum(key_max, tau)
    return torch.cat([torch.ones(1), torch.pow(gamma, alpha), torch.pow(gamma_k, 1.0 - alpha),
                      gamma])


def check_max_logits(bound: Bound | None, max_logits) -> dict | None:
    """{layer name: float32 CPU maxima} from ``step(qk_max_logits=...)``, or
    ValueError / TypeError naming the layer and the rule (nothing applied)."""
    if max_logits is None:
        return None
    if bound is None:
        raise ValueError("step(qk_max_logits=...) needs an optimizer built with "
                         "qk_clip=muond.torch.QKClip([...])")
    if not isinstance(max_logits, dict):
        raise TypeError("qk_max_logits must be a dict {layer name: tensor [num_heads]}, not "
                        f"{type(max_logits).__name__}")
    unknown = sorted(set(max_logits) - set(bound.layers), key=str)
    missing = sorted(set(bound.layers) - set(max_logits))
    if unknown or missing:
        raise ValueError(f"qk_max_logits must name every qk_clip layer once: unknown "
                         f"{unknown}, missing {missing}")
    out = {}
    for name, value in max_logits.items():
        n = bound.layers[name].num_heads
        if is_dtensor(value):
            raise TypeError(f"qk_max_logits[{name!r}] is a DTensor; give the job-wide maxima "
                            "as a plain tensor (muond.torch.reduce_max_logits)")
        value = torch.as_tensor(value).detach()
        if tuple(value.shape) != (n,):
            raise ValueError(f"qk_max_logits[{name!r}] has shape {tuple(value.shape)}, "
                             f"expected ({n},) (num_heads)")
        if not value.is_floating_point():
            value = value.double()
        value = value.to("cpu", torch.float32)
        bad = (~torch.isfinite(value)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"qk_max_logits[{name!r}] is not finite at heads {bad} "
                             f"({[value[h].item() for h in bad]}); nothing was applied")
        out[name] = value
    return out


def prepare(bound: Bound | None, max_logits, opt) -> list:
    """[(param, row factors)] to apply after the step (empty when no head is
    above the threshold); every check first, so a refusal changes nothing."""
    maxima = check_max_logits(bound, max_logits)
    if not maxima:
        return []
    tables = {name: factor_table(bound.layers[name], s, bound.config.threshold,
                                 bound.config.alpha) for name, s in maxima.items()}
    pending = []
    for w in bound.weights:
        table = tables[w.layer.name]
        if bool((table == 1).all()):
            continue
        # The factors are gathered on the param's device at apply: no host
        # work per row. table[0] == 1 keeps a row (x * 1 is x, bitwise).
        pending.append((w.param, table, w.held_index(opt)))
    return pending


@torch.no_grad()
def apply(pending: list, responses) -> None:
    """Scales each param's held rows in place, unless the daemons skipped
    the step (--skip_nonfinite: every rank reports it)."""
    if not pending or any(r.skipped_nonfinite for r in responses):
        return
    for param, table, index in pending:
        held = param.to_local() if is_dtensor(param) else param.data
        factors = table.to(held.device)[index]
        held.mul_(factors.view(-1, *([1] * (held.dim() - 1))))


def reduce_max_logits(max_logits: dict, group=None) -> dict:
    """The job-wide maxima of every rank's per-layer, per-head maxima: one
    MAX all-reduce over ``group`` (torch.distributed's default group when
    None) of all layers packed into one float32 tensor (in sorted name
    order), on the tensors' device (CUDA for NCCL). Every rank must call it
    with the same layer names and shapes. Without torch.distributed (or a
    world of 1) the maxima as float32."""
    names = sorted(max_logits)
    values = [torch.as_tensor(max_logits[n]).detach() for n in names]
    if not values:
        return {}
    devices = {v.device for v in values}
    if len(devices) > 1:
        raise ValueError(f"max logits on several devices {sorted(map(str, devices))}")
    flat = torch.cat([v.reshape(-1).to(torch.float32) for v in values])
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    out, at = {}, 0
    for name, v in zip(names, values):
        out[name] = flat[at:at + v.numel()].view(v.shape).clone()
        at += v.numel()
    return out
