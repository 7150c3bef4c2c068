"""Where each param of a torchrun trainer lives in muond's D x G x T domains.

Pure functions (no daemon, no RPC): ``muond.torch.Muon`` in local mode calls
``place_params`` once and registers what it returns; the multi-process tests
call the pieces directly. Which daemon a trainer rank talks to is
``muond.torch.discovery``'s.

Domains (docs/ARCHITECTURE.md "Sharding"; the wire's Domain D x G x T,
flat rank (d*G + g)*T + t):

* A DTensor param (FSDP2, DTensor TP, FSDP + TP, HSDP): every mesh dim gets
  one role from the placements of ALL Muon params on that mesh (``mesh_roles``):
  a dim named "tp", or where some Muon param is Shard(1), is the TP axis; a
  dim where some Muon param is Shard(0) / _StridedShard(0) is the GTP_remat
  axis; a dim where every Muon param is Replicate is a DP axis (several DP
  dims flatten, row-major, into one d). A param Shard(0) on the TP axis is
  column-parallel (tp_dim 0), Shard(1) row-parallel (tp_dim 1), Replicate
  TP-replicated. The GTP shard applies to the TP-local rows (FSDP2 on a
  2-D mesh writes that as _StridedShard(0, split_factor=T); with T == 1 a
  plain Shard(0): a dim of one rank cuts nothing); its row blocks
  are torch.chunk's (FSDP2's): uneven blocks, even empty ones, travel as
  ``gtp_rows``. An uneven TP split is refused naming the param. The domain
  is the whole mesh; its name is derived from the mesh's rank layout and
  the roles (``domain_name``), so it is the same on every rank. A param on
  a slice of a larger root mesh (FSDP2 + TP: ``fully_shard(mesh=mesh["dp"])``
  on a matrix outside the TP plan, replicated over tp) has the root mesh as
  its domain, the dims its mesh lacks as DP axes (``on_root_mesh``): its
  NS runs once, not once per TP column.
* A plain param when torch.distributed runs with world > 1 and the param has
  no Megatron tags (and no gtp_size/tp_size was given): a DDP replica,
  domain ``ddp-w<world>`` = D x 1 x 1 with D = world, d = rank.
* A Megatron-tagged param (``tensor_model_parallel``, ``partition_dim``,
  ``is_gtp_weight_remat``, ``pad_length``, ``full_shape``) or any plain param
  when gtp_size/tp_size were given: the given domain, (G, T, g, t); (D, d)
  from every rank's claim (``replicas``: ranks claiming the same (domain, g,
  t) are replicas, d by global rank) unless dp_size/dp_rank are given.
* AdamW params: a per-rank 1x1x1 domain ``solo-r<rank>`` (elementwise: no
  communication).

``check_layout`` compares every rank's ``summary`` (all-gathered before any
RPC) and raises the same ValueError on every rank when they disagree.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

from muond import batched as _batched
from muond._dtensor import is_dtensor
from muond.torch import qkv_placement as _qkv_placement

ROLE_DP, ROLE_GTP, ROLE_TP = "dp", "gtp", "tp"
DDP_DOMAIN_PREFIX = "ddp-w"
SOLO_DOMAIN_PREFIX = "solo-r"
MEGATRON_TAGS = ("tensor_model_parallel", "partition_dim", "is_gtp_weight_remat",
                 "pad_length", "full_shape")


@dataclass(frozen=True)
class ParamPlace:
    """One param's place: its domain (name, D x G x T, this rank's (d, g, t))
    and its shard of the full matrix. ``tp_dim``: the dim TP splits (0 =
    column-parallel, 1 = row-parallel), None when not TP-split.
    ``gtp_sharded``: dim 0 of the TP-local block is split over G;
    ``gtp_rows``: the rows each g holds (TP-local rows + pad_length), () for G
    equal blocks. ``kind``: "dtensor", "ddp", "megatron" (given domain),
    "solo" (AdamW's per-rank domain) or "plain" (an untagged param in the given domain).
    ``offset``: a batched param's matrix (muond.batched): the element offset
    of its shard in the param's local tensor (0 otherwise)."""
    domain: str
    D: int
    d: int
    G: int
    g: int
    T: int
    t: int
    full_shape: tuple
    local_shape: tuple
    tp_dim: int | None = None
    gtp_sharded: bool = False
    gtp_rows: tuple = ()
    pad_length: int = 0
    kind: str = "plain"
    offset: int = 0
    qkv_split: tuple = ()  # a split QKV weight's (qkv_split_shapes, qkv_head_dim)
    # Placed by its group's own Options (Request.options), not the
    # optimizer's: its wire group is named with the domain (the same param
    # group may sit in other domains on other ranks: experts per EP rank).
    own_domain: bool = False

    @property
    def coordinate(self) -> tuple:
        return (self.d, self.g, self.t)


# -- DTensor meshes ----------------------------------------------------------
def _shard_dim(placement) -> int | None:
    """The tensor dim a Shard / _StridedShard placement splits, else None."""
    if placement.is_shard() or _is_strided(placement):  # not a Shard in torch >= 2.10
        return int(placement.dim)
    return None


def _is_strided(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"


def mesh_roles(mesh, placements_of_params, where: str = "") -> tuple:
    """The role of each mesh dim (ROLE_TP, ROLE_GTP, ROLE_DP) from the
    placements of every Muon param on `mesh` (module docstring), or
    ValueError naming the mesh dim."""
    names = tuple(mesh.mesh_dim_names or ())
    roles = []
    for i in range(mesh.ndim):
        dims = [_shard_dim(pl[i]) for pl in placements_of_params]
        if any(pl[i].is_partial() for pl in placements_of_params):
            raise ValueError(f"{where}mesh dim {i}: a Muon param is Partial there; muond "
                             "needs the param Shard or Replicate on every mesh dim")
        if (names and names[i] == "tp") or 1 in dims:
            roles.append(ROLE_TP)
        elif 0 in dims:
            roles.append(ROLE_GTP)
        elif all(d is None for d in dims):
            roles.append(ROLE_DP)
        else:
            raise ValueError(f"{where}mesh dim {i}: Muon params sharded on dim "
                             f"{sorted(set(d for d in dims if d is not None))}; muond shards "
                             "2-D matrices on dim 0 (GTP_remat/column TP) or 1 (row TP)")
    for role in (ROLE_TP, ROLE_GTP):
        if roles.count(role) > 1:
            dims = [i for i, r in enumerate(roles) if r == role]
            raise ValueError(f"{where}mesh dims {dims} are all {role.upper()} axes; muond has "
                             f"one {role.upper()} axis per domain (flatten them into one mesh dim)")
    return tuple(roles)


def mesh_key(mesh) -> tuple:
    """Equal for equal meshes (the same rank layout and dim names), also
    when they are different DeviceMesh objects (slices made twice)."""
    return (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh_dim_names or ()))


def domain_name(mesh, roles) -> str:
    """A name for the domain of `mesh` with `roles`, the same on every rank
    (from the mesh's whole rank layout) and different for different meshes."""
    sizes = _sizes(mesh.mesh.shape, roles)
    key = repr((tuple(mesh.mesh.shape), mesh.mesh.flatten().tolist(), tuple(roles)))
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return f"mesh-{sizes[0]}x{sizes[1]}x{sizes[2]}-{digest}"


def _sizes(shape, roles):
    D = math.prod(int(shape[i]) for i, r in enumerate(roles) if r == ROLE_DP)
    G = next((int(shape[i]) for i, r in enumerate(roles) if r == ROLE_GTP), 1)
    T = next((int(shape[i]) for i, r in enumerate(roles) if r == ROLE_TP), 1)
    return D, G, T


def mesh_coordinate(mesh, rank: int) -> tuple:
    """`rank`'s coordinate in `mesh` (from the rank layout, not the mesh's
    cached coordinate), or ValueError when the rank is not in it."""
    hits = (mesh.mesh == int(rank)).nonzero().tolist()
    if not hits:
        raise ValueError(f"rank {rank} is not in the param's device mesh "
                         f"{mesh.mesh.tolist()}")
    return tuple(hits[0])


def chunk_rows(rows: int, parts: int) -> tuple:
    """torch.chunk's block sizes of `rows` over `parts` (FSDP2's Shard(0)):
    ceil(rows/parts) each until the rows run out, then 0 (e.g. 38/2 ->
    19, 19; 37/2 -> 19, 18; 3/4 -> 1, 1, 1, 0)."""
    size = -(-rows // parts) if rows else 0
    return tuple(max(0, min(size, rows - i * size)) for i in range(parts))


def place_dtensor(name: str, full_shape, local_shape, mesh, placements, roles,
                  rank: int) -> ParamPlace:
    """One 2-D DTensor Muon param's place in the domain of its mesh (module
    docstring), or ValueError naming the param and the rule."""
    if len(full_shape) != 2:
        raise ValueError(f"param {name}: Muon params must be 2-D, got {tuple(full_shape)}")
    P, Q = (int(s) for s in full_shape)
    coord = mesh_coordinate(mesh, rank)
    shape = tuple(int(s) for s in mesh.mesh.shape)
    D, G, T = _sizes(shape, roles)
    i_tp = roles.index(ROLE_TP) if ROLE_TP in roles else None
    i_g = roles.index(ROLE_GTP) if ROLE_GTP in roles else None
    dp_dims = [i for i, r in enumerate(roles) if r == ROLE_DP]
    d = 0
    for i in dp_dims:  # row-major over the DP dims
        d = d * shape[i] + coord[i]
    g = coord[i_g] if i_g is not None else 0
    t = coord[i_tp] if i_tp is not None else 0
    tp_dim = None
    if i_tp is not None:
        pl = placements[i_tp]
        if _is_strided(pl):
            raise ValueError(f"param {name}: _StridedShard on the TP mesh dim {i_tp} is not a "
                             "layout muond knows")
        tp_dim = _shard_dim(pl)
        if tp_dim is not None and (P, Q)[tp_dim] % T:
            raise ValueError(f"param {name}: TP splits dim {tp_dim} of {P}x{Q} over {T} ranks "
                             f"unevenly ({(P, Q)[tp_dim]} % {T} != 0); muond needs TP splits "
                             "that divide (GTP/FSDP row blocks may be uneven)")
    rows = P // T if tp_dim == 0 else P
    gtp_sharded, gtp_rows = False, ()
    if i_g is not None and _shard_dim(placements[i_g]) == 0:
        pl = placements[i_g]
        if tp_dim == 0:
            # The GTP block must cut the TP-local rows: a plain Shard(0) only
            # after the TP dim, a strided one with split_factor T before it.
            # When either dim has one rank it cuts nothing and the order is
            # moot (FSDP2 on a (dp, tp=1) mesh writes a plain Shard(0)).
            ok = (min(G, T) == 1 or (int(getattr(pl, "split_factor", 0)) == T
                                     if _is_strided(pl) else i_g > i_tp))
            if not ok:
                raise ValueError(
                    f"param {name}: its dim-0 shards on mesh dims {i_g} (GTP/FSDP) and "
                    f"{i_tp} (TP) cut the full rows before the TP blocks; muond needs the TP "
                    "split first (FSDP2 on a (dp, tp) mesh writes _StridedShard(0))")
        elif _is_strided(pl):
            raise ValueError(f"param {name}: _StridedShard(0) on mesh dim {i_g} without a "
                             "column-parallel TP split is not a layout muond knows")
        gtp_sharded = True
        blocks = chunk_rows(rows, G)
        if len(set(blocks)) > 1:
            gtp_rows = blocks
    expected_rows = ((gtp_rows[g] if gtp_rows else rows // G) if gtp_sharded else rows)
    expected = (expected_rows, Q // T if tp_dim == 1 else Q)
    if tuple(int(s) for s in local_shape) != expected:
        raise ValueError(f"param {name}: local shard {tuple(local_shape)} on rank {rank}, but "
                         f"placements {tuple(placements)} on mesh {mesh.mesh.tolist()} give "
                         f"{expected}")
    return ParamPlace(domain_name(mesh, roles), D, d, G, g, T, t, (P, Q), expected,
                      tp_dim=tp_dim if T > 1 else None, gtp_sharded=gtp_sharded and G > 1,
                      gtp_rows=gtp_rows if G > 1 else (), kind="dtensor")


# -- plain params -------------------------------------------------------------
def has_megatron_tags(p) -> bool:
    return any(hasattr(p, tag) for tag in MEGATRON_TAGS)


def place_ddp(shape, world: int, rank: int) -> ParamPlace:
    shape = tuple(int(s) for s in shape)
    return ParamPlace(f"{DDP_DOMAIN_PREFIX}{world}", world, rank, 1, 0, 1, 0, shape, shape,
                      kind="ddp")


def place_solo(shape, rank: int) -> ParamPlace:
    shape = tuple(int(s) for s in shape)
    return ParamPlace(f"{SOLO_DOMAIN_PREFIX}{rank}", 1, 0, 1, 0, 1, 0, shape, shape,
                      kind="solo")


def place_megatron(p, full_shape, domain: str, G: int, T: int, g: int, t: int,
                   D: int = 1, d: int = 0) -> ParamPlace:
    tp = bool(getattr(p, "tensor_model_parallel", False))
    pd = int(getattr(p, "partition_dim", 0))
    return ParamPlace(domain, D, d, G, g, T, t, tuple(int(s) for s in full_shape),
                      tuple(int(s) for s in p.shape),
                      tp_dim=pd if tp and T > 1 and pd in (0, 1) else None,
                      gtp_sharded=bool(getattr(p, "is_gtp_weight_remat", False)) and G > 1,
                      pad_length=int(getattr(p, "pad_length", 0)), kind="megatron")


def replicas(claims, rank: int) -> dict:
    """{domain: (D, d)} for `rank` from every rank's claims (claims[r] = list
    of (domain, G, T, g, t)): the ranks claiming the same (domain, g, t) are
    DP replicas, numbered by global rank. ValueError (the same on every
    rank) when the (g, t) of a domain have different replica counts."""
    holders: dict = {}
    for r, rank_claims in enumerate(claims):
        for domain, G, T, g, t in rank_claims:
            holders.setdefault(domain, {}).setdefault((g, t), []).append(r)
    out = {}
    for domain in sorted(holders):
        counts = {gt: len(rs) for gt, rs in holders[domain].items()}
        if len(set(counts.values())) > 1:
            detail = ", ".join(f"(g={g}, t={t}): ranks {holders[domain][(g, t)]}"
                               for g, t in sorted(counts))
            raise ValueError(f"domain {domain!r}: its (g, t) have different numbers of DP "
                             f"replicas ({detail}); every (g, t) needs the same replicas "
                             "(or pass dp_size/dp_rank)")
        for (g, t), rs in holders[domain].items():
            if rank in rs:
                out[domain] = (len(rs), rs.index(rank))
    return out


# -- the whole optimizer -------------------------------------------------------
@dataclass
class Request:
    """What place_params needs of one param."""
    name: str
    param: object        # the tensor (a DTensor or a plain tensor)
    algorithm: str       # "muon" | "adamw"
    split: object = None  # a split QKV param's muond.qkv_split.RowSplit
    # The domain and (G, T, g, t) of this param's group when they differ
    # from the optimizer's (muond.megatron: expert groups); None: the
    # optimizer's Options.
    options: object = None


@dataclass
class Options:
    rank: int = 0
    world: int = 1
    domain: str = "dense"
    gtp_size: int = 1
    tp_size: int = 1
    g: int = 0
    t: int = 0
    dp_size: int | None = None
    dp_rank: int | None = None
    given_grid: bool = False  # gtp_size/tp_size/g/t given: plain params are Megatron shards


def on_root_mesh(mesh, placements, rank: int):
    """(root mesh, placements on it, the root dims the param's mesh lacks)
    when the param's mesh is a slice of a larger root mesh (FSDP2 + TP:
    ``fully_shard(mesh=mesh["dp"])`` on a param outside the TP plan): the
    root dims it lacks hold the same shard on every rank (the slice at
    each of their coordinates has the same layout and placements), so they
    are DP axes (replicas) and its NS runs once per job, not once per slice.
    None when the mesh is its own root or not a plain slice of it (a
    flattened dim, another dim order): the param's own mesh is its domain."""
    root_of = getattr(mesh, "_get_root_mesh", None)
    root = root_of() if root_of is not None else None
    if root is None or root is mesh or root.ndim <= mesh.ndim:
        return None
    names, root_names = tuple(mesh.mesh_dim_names or ()), tuple(root.mesh_dim_names or ())
    if (len(names) != mesh.ndim or not set(names) <= set(root_names)
            or [n for n in root_names if n in names] != list(names)):
        return None
    coord = mesh_coordinate(root, rank)
    index = tuple(slice(None) if n in names else coord[i] for i, n in enumerate(root_names))
    if not root.mesh[index].equal(mesh.mesh):
        return None
    from torch.distributed.tensor import Replicate
    own = dict(zip(names, placements))
    missing = tuple(i for i, n in enumerate(root_names) if n not in names)
    return root, tuple(own.get(n, Replicate()) for n in root_names), missing


def _domain_mesh(mesh, placements, roles, rank: int):
    """(mesh, placements, roles) of the param's domain: its own mesh, or
    its root mesh with the missing dims as DP axes (``on_root_mesh``)."""
    rooted = on_root_mesh(mesh, placements, rank)
    if rooted is None:
        return mesh, placements, roles
    root, root_placements, missing = rooted
    own = iter(roles)
    return root, root_placements, tuple(ROLE_DP if i in missing else next(own)
                                        for i in range(root.ndim))


def place_params(requests, default_opts: Options) -> dict:
    """{param name: ParamPlace} for this rank (module docstring), without
    any communication: a Megatron param's (D, d) is the given dp_size/dp_rank
    or (1, 0) until ``settle`` resolves it from every rank's claims."""
    distributed = default_opts.world > 1
    places = {}
    by_mesh: dict = {}
    for req in requests:
        if req.algorithm == "muon" and is_dtensor(req.param):
            by_mesh.setdefault(mesh_key(req.param.device_mesh), []).append(req)
    from muond.torch import batched_placement as _bp  # noqa: PLC0415 (it imports this)
    roles_of = {key: mesh_roles(reqs[0].param.device_mesh,
                                [_bp.matrix_placements(r.param.placements, r.param.ndim)
                                 for r in reqs],
                                f"param {reqs[0].name}'s ")
                for key, reqs in by_mesh.items()}
    for req in requests:
        p, opts = req.param, req.options or default_opts
        placed_before = set(places)
        local_shape = tuple(p.to_local().shape) if is_dtensor(p) else tuple(p.shape)
        if req.algorithm != "muon":
            places[req.name] = (place_solo(local_shape, opts.rank) if distributed
                                else _place_in_given_domain(p, opts))
        elif _batched.is_batched(p.shape):
            places.update(_place_batched(req.name, p, local_shape, roles_of, opts))
        elif is_dtensor(p):
            mesh, placements, roles = _domain_mesh(p.device_mesh, tuple(p.placements),
                                                   roles_of[mesh_key(p.device_mesh)], opts.rank)
            places[req.name] = place_dtensor(req.name, tuple(p.shape), local_shape, mesh,
                                             placements, roles, opts.rank)
        elif distributed and not opts.given_grid and not has_megatron_tags(p):
            places[req.name] = place_ddp(p.shape, opts.world, opts.rank)
        else:
            places[req.name] = _place_in_given_domain(p, opts)
        if req.options is not None:  # the param's place, or its matrices' (batched)
            for key in set(places) - placed_before:
                places[key] = replace(places[key], own_domain=True)
        if req.split is not None:  # its split and matrices too, for the ranks to agree on
            places[req.name] = replace(places[req.name],
                                       qkv_split=(req.split.shapes, req.split.head_dim))
            places.update(_qkv_placement.split_places(req.name, places[req.name], req.split)[0])
    return places


def _place_batched(name: str, p, local_shape, roles_of: dict, opts: Options) -> dict:
    """{matrix wire name: ParamPlace} of a batched Muon param
    (muond.torch.batched_placement)."""
    from muond.torch import batched_placement as _bp  # noqa: PLC0415 (it imports this)
    if is_dtensor(p):
        mesh, placements, roles = _domain_mesh(p.device_mesh, tuple(p.placements),
                                               roles_of[mesh_key(p.device_mesh)], opts.rank)
        return _bp.place_dtensor_batch(name, tuple(p.shape), local_shape, mesh, placements,
                                       roles, opts.rank)
    if has_megatron_tags(p):
        _bp.refuse_tagged(name, p.shape)
    whole = (place_ddp(p.shape, opts.world, opts.rank)
             if opts.world > 1 and not opts.given_grid else _place_in_given_domain(p, opts))
    return _bp.place_plain_batch(name, p.shape, whole)


def claims(places: dict, dp_given: bool) -> list:
    """This rank's (domain, G, T, g, t) for the domains whose (D, d) comes
    from every rank's claims (Megatron/plain params without dp_size)."""
    if dp_given:
        return []
    return sorted({(pl.domain, pl.G, pl.T, pl.g, pl.t) for pl in places.values()
                   if pl.kind in ("megatron", "plain")})


def with_replicas(places: dict, every_claims, rank: int) -> dict:
    """`places` with the (D, d) that ``replicas`` finds for the claimed domains."""
    dp = replicas(every_claims, rank)
    return {name: (replace(pl, D=dp[pl.domain][0], d=dp[pl.domain][1])
                   if pl.kind in ("megatron", "plain") and pl.domain in dp else pl)
            for name, pl in places.items()}


def settle(compute, rank: int, world: int, gather, dp_given: bool = False) -> dict:
    """The collective part, run by every rank together: ``compute()`` (this
    rank's place_params, which may raise ValueError) on every rank, the
    errors and claims all-gathered, then the summaries (check_layout). Any
    rank's refusal is raised on EVERY rank with the same message (naming the
    rank), so no rank is left waiting in a later collective or RPC."""
    own = None
    try:
        places, error = compute(), None
    except Exception as e:  # noqa: BLE001 (every rank raises it below)
        own = e
        places, error = {}, (str(e) if isinstance(e, ValueError)
                             else f"{type(e).__name__}: {e}")
    if world <= 1:
        if own is not None:
            raise own
        return places
    every = gather({"error": error, "claims": claims(places, dp_given)})
    failed = [(r, o["error"]) for r, o in enumerate(every) if o["error"] is not None]
    if failed:
        r, message = failed[0]
        others = [f for f, _ in failed[1:]]
        raise ValueError(f"rank {r}: {message}" +
                         (f" (ranks {others} refused too)" if others else "")) from own
    if any(o["claims"] for o in every):
        places = with_replicas(places, [o["claims"] for o in every], rank)
    check_layout(gather(summary(places)))
    return places


def _place_in_given_domain(p, opts: Options) -> ParamPlace:
    """A plain or Megatron-tagged param in the given domain and (G, T, g, t),
    its shard facts from its Megatron tags (kind "megatron" when tagged,
    else "plain")."""
    from muond import split as _split  # noqa: PLC0415 (avoid a cycle at import)
    tp = bool(getattr(p, "tensor_model_parallel", False))
    pd = int(getattr(p, "partition_dim", 0))
    gtp = bool(getattr(p, "is_gtp_weight_remat", False))
    pad = int(getattr(p, "pad_length", 0))
    full = list(getattr(p, "full_shape", p.shape))
    if not hasattr(p, "full_shape") and p.ndim == 2:
        full = _split.full_shape_from_local(
            p.shape, opts.gtp_size, opts.tp_size, tensor_model_parallel=tp,
            partition_dim=pd, is_gtp_weight_remat=gtp, pad_length=pad)
    D, d = (int(opts.dp_size), int(opts.dp_rank or 0)) if opts.dp_size else (1, 0)
    return ParamPlace(opts.domain, D, d, opts.gtp_size, opts.g, opts.tp_size, opts.t,
                      tuple(int(s) for s in full), tuple(int(s) for s in p.shape),
                      tp_dim=pd if tp else None, gtp_sharded=gtp, pad_length=pad,
                      kind="megatron" if has_megatron_tags(p) else "plain")


# -- the layout pre-check -------------------------------------------------------
def summary(places: dict) -> dict:
    """What check_layout compares of one rank: its coordinate and size in
    every domain it is in (per-rank solo domains left out: nothing to agree
    on) and each Muon param's domain and shape facts."""
    domains, params = {}, {}
    for name, pl in places.items():
        if pl.kind == "solo":
            continue
        domains[pl.domain] = ((pl.D, pl.G, pl.T), pl.coordinate)
        params[name] = (pl.domain, tuple(pl.full_shape), pl.tp_dim, bool(pl.gtp_sharded),
                        tuple(pl.gtp_rows), int(pl.pad_length), tuple(pl.qkv_split))
    return {"domains": domains, "params": params}


_PARAM_FIELDS = ("domain", "full_shape", "tp_dim", "gtp_sharded", "gtp_rows", "pad_length",
                 "qkv_split (qkv_split_shapes, qkv_head_dim)")


def check_layout(summaries) -> None:
    """Raises ValueError when the ranks' placements (summaries[r] =
    summary() of rank r, the same list on every rank) disagree, naming the
    domain or param, the ranks and the field; the same message on every
    rank, so every rank stops before any RPC."""
    members: dict = {}
    for r, s in enumerate(summaries):
        for domain, (size, coord) in s["domains"].items():
            members.setdefault(domain, []).append((r, tuple(size), tuple(coord)))
    for domain in sorted(members):
        ranks = members[domain]
        r0, size0, _ = ranks[0]
        for r, size, _ in ranks[1:]:
            if size != size0:
                raise ValueError(f"domain {domain!r}: rank {r0} has D x G x T = "
                                 f"{'x'.join(map(str, size0))}, rank {r} "
                                 f"{'x'.join(map(str, size))}")
        seen = {}
        for r, _, coord in ranks:
            if coord in seen:
                raise ValueError(f"domain {domain!r}: ranks {seen[coord]} and {r} both claim "
                                 f"(d, g, t) = {coord}")
            seen[coord] = r
        D, G, T = size0
        missing = [(d, g, t) for d in range(D) for g in range(G) for t in range(T)
                   if (d, g, t) not in seen]
        if missing:
            raise ValueError(f"domain {domain!r} ({D}x{G}x{T}): no rank claims (d, g, t) = "
                             f"{missing[:4]}{' ...' if len(missing) > 4 else ''} (ranks "
                             f"{[r for r, _, _ in ranks]} claim {sorted(seen)})")
        names = {r: {n for n, f in summaries[r]["params"].items() if f[0] == domain}
                 for r, _, _ in ranks}
        every = set().union(*names.values())
        for name in sorted(every):
            lacking = [r for r in names if name not in names[r]]
            if lacking:
                having = [r for r in names if name in names[r]]
                raise ValueError(f"param {name}: in domain {domain!r} on ranks {having} but "
                                 f"not on ranks {lacking} (every rank of a domain registers "
                                 "the same Muon params)")
    # Within a domain (one name may live in several domains: FSDP's params
    # of a (dp, tp) job are on one dp mesh per TP rank).
    facts: dict = {}
    for r, s in enumerate(summaries):
        for name, f in s["params"].items():
            facts.setdefault((name, f[0]), []).append((r, f))
    for name, domain in sorted(facts):
        r0, f0 = facts[(name, domain)][0]
        for r, f in facts[(name, domain)][1:]:
            for i, label in enumerate(_PARAM_FIELDS):
                if f[i] != f0[i]:
                    raise ValueError(f"param {name} (domain {domain!r}): {label} is {f0[i]!r} "
                                     f"on rank {r0} but {f[i]!r} on rank {r}")
