"""Single-trainer split mode: one trainer's full weights sharded over G x T daemons.

The daemons of a GTP_remat x TP domain (docs/ARCHITECTURE.md "Sharding") each expect *their*
shard of every Muon weight, as Megatron would hold it: TP splits the full
(P, Q) weight along ``tp_dim`` into T blocks, then GTP_remat splits dim 0 of
the TP-local block into G pieces after ``pad_length`` trailing zero rows make
it divisible by G. Here one trainer holds the full weight, so the client lays
the weight out in one buffer such that every shard is a strided view into it
(no copies) and hands daemon ``rank = g * T + t`` its view.

Buffer layout (row-major, ``Q`` columns, element strides ``[Q, 1]``):

* ``tp_dim = 1`` (row-parallel, T blocks of columns): ``P + pad`` rows, the
  real weight in rows ``[0, P)``, ``pad = (-P) % G`` zero rows after it (the TP
  blocks share their rows, so their pad rows are the same rows).
  Shard (g, t): rows ``[g*R, (g+1)*R)``, columns ``[t*Q/T, (t+1)*Q/T)`` with
  ``R = (P + pad) / G``; byte offset ``(g*R*Q + t*Q/T) * itemsize``.
* ``tp_dim = 0`` (column-parallel, T blocks of rows) or ``T = 1``: P rows when
  T > 1 (only used when ``P/T`` divides by G: padding each TP block would put
  pad rows *between* the blocks and the model's (P, Q) tensor would not be a
  strided view any more), ``P + pad`` rows when T = 1. Shard (g, t): rows
  ``[t*P/T + g*R, t*P/T + (g+1)*R)``, all columns, ``R = (P/T + pad) / G``.

The model's param is always the contiguous prefix ``buffer[:P*Q].view(P, Q)``.

Choice of ``tp_dim`` when T > 1: the param's preferred dim (Megatron tag
``partition_dim`` when ``tensor_model_parallel``; 0 when untagged), else the
other dim; a dim works when it divides by T and (dim 0) needs no padding. A
weight for which neither works (or that is not 2-D) is *not split*: it goes
whole to one daemon as a 1x1 domain (see muond.torch). TP-replicated or
GTP-replicated placement is never used in single-trainer mode: every daemon
of the domain would apply the update to the same memory, G*T times.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    rank: int                 # flat rank in the domain, g * T + t
    g: int
    t: int
    offset: int               # elements from the buffer base
    shape: tuple[int, int]
    strides: tuple[int, int]  # elements


@dataclass(frozen=True)
class SplitLayout:
    full_shape: tuple[int, int]
    gtp_size: int
    tp_size: int
    tp_dim: int | None        # None when T == 1 (no TP axis)
    pad_length: int           # GTP pad rows per TP-local block (0 when G == 1)
    buffer_rows: int          # the buffer is buffer_rows x Q
    shards: tuple[Shard, ...]

    @property
    def buffer_numel(self) -> int:
        return self.buffer_rows * self.full_shape[1]

    @property
    def tp_sharded(self) -> bool:
        return self.tp_size > 1

    @property
    def gtp_sharded(self) -> bool:
        return self.gtp_size > 1


def _dim_works(P: int, Q: int, G: int, T: int, dim: int) -> bool:
    if dim == 1:
        return Q % T == 0
    return P % T == 0 and (P // T) % G == 0


def plan_split(full_shape, gtp_size: int, tp_size: int,
               preferred_tp_dim: int | None = None) -> SplitLayout | None:
    """The layout of a (P, Q) weight over G x T daemons, or None when it is not
    splittable (not 2-D, or no tp_dim works)."""
    G, T = int(gtp_size), int(tp_size)
    if G < 1 or T < 1:
        raise ValueError(f"gtp_size and tp_size must be >= 1, got {G} x {T}")
    if len(full_shape) != 2 or min(full_shape) < 1:
        return None
    P, Q = (int(s) for s in full_shape)
    tp_dim = None
    if T > 1:
        first = 1 if preferred_tp_dim == 1 else 0
        for dim in (first, 1 - first):
            if _dim_works(P, Q, G, T, dim):
                tp_dim = dim
                break
        if tp_dim is None:
            return None
    shards = []
    if tp_dim == 1:
        pad = (-P) % G
        R, Qt = (P + pad) // G, Q // T
        for g in range(G):
            for t in range(T):
                shards.append(Shard(g * T + t, g, t, g * R * Q + t * Qt, (R, Qt), (Q, 1)))
        return SplitLayout((P, Q), G, T, 1, pad, P + pad, tuple(shards))
    Pt = P // T
    pad = (-Pt) % G  # 0 when T > 1 (checked by _dim_works)
    R = (Pt + pad) // G
    for g in range(G):
        for t in range(T):
            shards.append(Shard(g * T + t, g, t, (t * Pt + g * R) * Q, (R, Q), (Q, 1)))
    shards.sort(key=lambda s: s.rank)
    return SplitLayout((P, Q), G, T, tp_dim, pad, P + pad, tuple(shards))


def full_shape_from_local(local_shape, gtp_size: int, tp_size: int, *,
                          tensor_model_parallel: bool = False, partition_dim: int = 0,
                          is_gtp_weight_remat: bool = False, pad_length: int = 0):
    """The full shape of a 2-D weight from its local shard and Megatron tags in a
    G x T domain: core/plan MakeShardSpec's rule (the daemon checks the two
    agree). An axis of size 1 ignores its tag; partition_dim -1 (or anything
    but 0 and 1) is TP-replicated. Checked against the C++ by the shared
    table tests/core/plan/sharding_cases.json."""
    G, T = int(gtp_size), int(tp_size)
    full = [int(d) for d in local_shape]
    if is_gtp_weight_remat and G > 1:
        full[0] = full[0] * G - int(pad_length)
    if tensor_model_parallel and T > 1 and partition_dim in (0, 1):
        full[partition_dim] *= T
    return full


def ns_cost(shape) -> int:
    """core/plan NsCostOfShape: max(P,Q) * min(P,Q)^2 for 2-D, else the element
    count (checked against the C++ by tests/core/plan/sharding_cases.json)."""
    if len(shape) == 2:
        P, Q = shape
        return max(P, Q) * min(P, Q) ** 2
    n = 1
    for s in shape:
        n *= s
    return n
