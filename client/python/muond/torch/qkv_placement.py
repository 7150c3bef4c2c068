"""Where each matrix of a split QKV param (muond.qkv_split) lives: the
param's own place (DTensor placements, DDP, Megatron tags; placement.py),
read per matrix.

A matrix is a selection of the param's full rows. Its TP split is the
param's: with column-parallel TP (tp_dim 0) every TP block must hold the same
number of the matrix's rows (query groups divide over the TP ranks), else it
is refused naming the matrix. Its GTP split (FSDP2's row chunks, Megatron's
GTP blocks) counts the matrix's rows in each chunk: uneven, or empty, as the
chunks cut the query groups, the same for every TP block. Its local rows are
the selected rows of this rank's shard, in order; ``perm`` lists them,
matrix after matrix: the staging copy's row i is the local row perm[i]."""
from __future__ import annotations

import bisect
from dataclasses import replace

from muond import qkv_split as _qkv_split


def _tp_block(place) -> tuple:
    """(first full row, rows) of this rank's TP block."""
    rows = place.full_shape[0]
    if place.tp_dim == 0:
        return place.t * rows // place.T, rows // place.T
    return 0, rows


def _gtp_chunks(place, tp_rows: int) -> tuple:
    """The GTP row chunks of a TP block (rows of each g), () when not split."""
    if not place.gtp_sharded:
        return ()
    return tuple(place.gtp_rows) or (tp_rows // place.G,) * place.G


def _count(selected: list, lo: int, hi: int) -> int:
    return bisect.bisect_left(selected, hi) - bisect.bisect_left(selected, lo)


def _matrix_rows_per_chunk(name: str, selected: list, place, tp_rows: int) -> tuple:
    """The matrix's rows in each GTP chunk, the same in every TP block, or
    ValueError naming the matrix."""
    chunks = _gtp_chunks(place, tp_rows) or (tp_rows,)
    blocks = place.T if place.tp_dim == 0 else 1
    seen = None
    for t in range(blocks):
        lo, counts = t * tp_rows, []
        for size in chunks:
            counts.append(_count(selected, lo, lo + size))
            lo += size
        if seen is not None and tuple(counts) != seen:
            raise ValueError(f"param {name}: column-parallel TP blocks hold its rows "
                             f"unevenly ({list(seen)} in block 0, {counts} in block {t}); the "
                             "query groups must divide over the TP ranks")
        seen = tuple(counts)
    return seen


def split_places(name: str, place, split) -> tuple[dict, list]:
    """({matrix wire name: ParamPlace}, perm) of a split QKV param at
    ``place``, or ValueError naming the param and the rule."""
    if len(place.full_shape) != 2:
        raise ValueError(f"param {name}: split_qkv splits a 2-D weight, this one has shape "
                         f"{tuple(place.full_shape)}")
    if place.pad_length:
        raise ValueError(f"param {name}: split_qkv with GTP pad rows (pad_length "
                         f"{place.pad_length}) is not a layout muond knows")
    cols = place.local_shape[1]
    tp_lo, tp_rows = _tp_block(place)
    chunks = _gtp_chunks(place, tp_rows)
    lo = tp_lo + (sum(chunks[:place.g]) if chunks else 0)
    hi = lo + (chunks[place.g] if chunks else tp_rows)
    places, perm = {}, []
    for wname, selected in _qkv_split.selections(name, place.full_shape[0], split):
        per_chunk = _matrix_rows_per_chunk(wname, selected, place, tp_rows)
        local = [r - lo for r in selected[bisect.bisect_left(selected, lo):
                                          bisect.bisect_left(selected, hi)]]
        gtp_rows = per_chunk if chunks and len(set(per_chunk)) > 1 else ()
        places[wname] = replace(place, full_shape=(len(selected), place.full_shape[1]),
                                local_shape=(len(local), cols), gtp_rows=gtp_rows,
                                offset=len(perm) * cols)
        perm.extend(local)
    return places, perm
