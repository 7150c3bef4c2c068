"""Where each matrix of a batched Muon param (muond.batched: ``[..., m, n]``,
the leading dims a batch of independent matrices) lives in muond's domains.

Every matrix is placed as a 2-D param of its own, named ``matrix_name``:

* A DTensor param: a shard of the matrix dims is read as the 2-D rule reads
  it (rows: Shard(0) of the matrix, on the GTP axis, or column-parallel TP on
  the TP axis; columns: row-parallel TP). A shard of a batch dim (FSDP2's
  Shard(0) of an ``[E, m, n]`` param, expert parallelism) puts each matrix
  whole on the mesh coordinate whose torch.chunk holds its index: on the
  GTP axis, that is an uneven row split where that coordinate holds every
  row and the others none (``gtp_rows``), so the daemons need nothing new. One
  mesh dim may shard the batch dims, not a TP axis, and not _StridedShard.
* A plain param (DDP replica or the given domain): every matrix has the
  param's place with its own 2-D shape. Megatron tags describe a 2-D weight:
  a tagged batched param is refused.
"""
from __future__ import annotations

import math
from dataclasses import replace

from muond import batched as _batched
from muond.torch import placement as _placement


def matrix_placements(placements, ndim: int) -> tuple:
    """A batched param's placements as its matrices see them, for the mesh
    roles (``placement.mesh_roles``): a shard of a batch dim or of the rows
    is Shard(0) (the GTP axis, or column-parallel TP), a shard of the columns
    Shard(1)."""
    from torch.distributed.tensor import Shard
    k = ndim - 2
    out = []
    for pl in placements:
        dim = _placement._shard_dim(pl)
        if dim is None:
            out.append(pl)
        elif dim < k or not _placement._is_strided(pl):
            out.append(Shard(max(0, dim - k)))
        else:
            out.append(type(pl)(dim - k, split_factor=pl.split_factor))
    return tuple(out)


def _batch_shard(name: str, placements, roles, k: int):
    """(mesh dim, batch dim) of the one mesh dim sharding a batch dim, or
    None; ValueError naming the param and the rule otherwise."""
    found = [(i, _placement._shard_dim(pl)) for i, pl in enumerate(placements)
             if _placement._shard_dim(pl) is not None and _placement._shard_dim(pl) < k]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"param {name}: its batch (expert) dims are sharded on mesh dims "
                         f"{[i for i, _ in found]}; muond takes one mesh dim sharding the "
                         "experts (flatten those mesh dims into one)")
    i, b = found[0]
    if _placement._is_strided(placements[i]):
        raise ValueError(f"param {name}: _StridedShard({b}) on mesh dim {i} over its batch "
                         "(expert) dims is not a layout muond knows")
    if roles[i] != _placement.ROLE_GTP:
        raise ValueError(f"param {name}: mesh dim {i} shards its batch (expert) dim {b} but "
                         f"is the domain's {roles[i].upper()} axis; muond shards the experts "
                         "over the mesh dim that shards rows (FSDP2's Shard(0), the GTP axis)")
    return i, b


def place_dtensor_batch(name: str, full_shape, local_shape, mesh, placements, roles,
                        rank: int) -> dict:
    """{matrix wire name: ParamPlace} of a batched DTensor param (module
    docstring), or ValueError naming the param and the rule."""
    k = len(full_shape) - 2
    batch, matrix = tuple(full_shape[:k]), tuple(int(s) for s in full_shape[k:])
    shard = _batch_shard(name, placements, roles, k)
    coord = _placement.mesh_coordinate(mesh, rank)
    local_batch = list(batch)
    owners = None
    if shard is not None:
        i, b = shard
        owners = _placement.chunk_rows(batch[b], int(mesh.mesh.shape[i]))
        local_batch[b] = owners[coord[i]]
    if tuple(int(s) for s in local_shape[:k]) != tuple(local_batch):
        raise ValueError(f"param {name}: local shard {tuple(local_shape)} on rank {rank}, but "
                         f"placements {tuple(placements)} on mesh {mesh.mesh.tolist()} give "
                         f"batch dims {tuple(local_batch)}")
    local_matrix = tuple(int(s) for s in local_shape[k:])
    as_matrix = list(matrix_placements(placements, len(full_shape)))
    if shard is not None:
        from torch.distributed.tensor import Replicate
        as_matrix[shard[0]] = Replicate()  # the batch shard: ownership, below
    step = math.prod(local_matrix)
    out = {}
    for index in _batched.batch_indices(batch):
        wname = _batched.matrix_name(name, index)
        place = _placement.place_dtensor(wname, matrix, local_matrix, mesh, tuple(as_matrix),
                                         roles, rank)
        local_index = list(index)
        if shard is not None:
            i, b = shard
            size = owners[0]
            owner = index[b] // size
            rows = place.local_shape[0]
            held = owner == coord[i]
            place = replace(place, gtp_sharded=True,
                            gtp_rows=tuple(rows if c == owner else 0 for c in range(len(owners))),
                            local_shape=(rows if held else 0, place.local_shape[1]))
            if not held:
                out[wname] = place
                continue
            local_index[b] -= owner * size
        out[wname] = replace(place, offset=_flat(local_index, local_batch) * step)
    return out


def place_plain_batch(name: str, shape, place) -> dict:
    """{matrix wire name: ParamPlace} of a batched plain param whose whole
    place is ``place`` (a DDP replica or the given domain, untagged)."""
    k = len(shape) - 2
    matrix = tuple(int(s) for s in shape[k:])
    batch = tuple(int(s) for s in shape[:k])
    return {_batched.matrix_name(name, index):
            replace(place, full_shape=matrix, local_shape=matrix,
                    offset=_flat(index, batch) * math.prod(matrix))
            for index in _batched.batch_indices(batch)}


def refuse_tagged(name: str, shape) -> None:
    raise ValueError(f"param {name}: Megatron tags (tensor_model_parallel, partition_dim, "
                     f"is_gtp_weight_remat) describe a 2-D weight, this param has shape "
                     f"{tuple(shape)}; give each expert as a 2-D param, or the experts as an "
                     "untagged [E, m, n] param (DTensor placements shard its expert dim)")


def _flat(index, shape) -> int:
    """Row-major position of ``index`` in ``shape``."""
    pos = 0
    for i, n in zip(index, shape):
        pos = pos * int(n) + int(i)
    return pos
