"""Muon params of more than two dims: a batch of independent matrices.

An ``[E, m, n]`` param (a model's experts as one tensor: torchtitan's
GroupedExperts, fused expert weights, grouped-GEMM weights) is E matrices of
m x n; any ``[..., m, n]`` param is the product of its leading dims in
matrices, each orthogonalised on its own, as dion and Megatron do. On the
wire every matrix is a param of its own (``matrix_name``): a strided view of
the param's memory with its own momentum, NS home and cost, so the daemons'
sharding, batching, balancing and exactness apply to each matrix unchanged,
and an expert tensor steps exactly as its matrices given as separate 2-D
params would.

``BatchLayout`` is where a batched param's state lives: one entry per matrix,
at its element offset in the param's local tensor (the whole param, or a
DTensor's local shard, whose matrices may be cut (rows or columns) or absent
(another rank's experts: an empty view))."""
from __future__ import annotations

import math
from dataclasses import dataclass


def is_batched(shape) -> bool:
    """A Muon param whose leading dims are a batch of matrices (ndim > 2)."""
    return len(shape) > 2


def batch_indices(batch_shape) -> list[tuple]:
    """Every matrix's index in the batch dims, row-major (the memory order)."""
    out = [()]
    for size in batch_shape:
        out = [index + (i,) for index in out for i in range(int(size))]
    return out


def matrix_name(name: str, index: tuple) -> str:
    """The wire name of matrix ``index`` of param ``name``: ``w[3]``, ``w[1,2]``."""
    return f"{name}[{','.join(str(i) for i in index)}]"


@dataclass(frozen=True)
class Matrix:
    """One matrix of a batched param: its wire name, its element offset and
    shape (rows, cols) in the param's local tensor (rows or cols 0 where this
    rank holds none of it) and its own layout (("solo", rank) or "local")."""
    name: str
    offset: int
    shape: tuple
    layout: object

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rank(self) -> int:
        """The daemon holding it (local mode: the trainer's one, 0)."""
        return self.layout[1] if isinstance(self.layout, tuple) else 0


@dataclass(frozen=True)
class BatchLayout:
    """A batched param's layout: its matrices in memory order. A split QKV
    param (muond.qkv_split) has the same layout over its staging copy, whose
    row i is the param's local row ``perm[i]``."""
    matrices: tuple
    perm: tuple = ()

    def ranks(self) -> list[int]:
        """The daemons holding some matrix of the param."""
        out = []
        for m in self.matrices:
            if m.rank not in out:
                out.append(m.rank)
        return out
