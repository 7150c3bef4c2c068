"""``muond.megatron.LayerShardedMuon``: Megatron-Core's LayerShardedMuon
constructor on muond daemons.

Megatron-Core's class routes each weight's momentum shards to one NS home
in the (GTP_remat x TP) domain of its process groups and back; here the
daemons do that routing, so the process groups only tell where this rank
sits: their sizes and this rank's coordinate in them are the domain's
(G, T, g, t), and the params' Megatron tags (``tensor_model_parallel``,
``partition_dim``, ``is_gtp_weight_remat``, ``pad_length``) say how each is
sharded (muond.torch.placement). With Megatron's pg_collection its DP
group (dp_cp / dp; expt_dp for experts) is the domain's DP axis, so NS runs
once per job, not once per DP replica; without it (the seed's API) each
domain runs its own. A domain is named by its ranks (``domain_members``), so
ranks of one param group in different domains (pipeline stages, expert-
parallel ranks) are never taken for replicas.
"""
from __future__ import annotations

import hashlib
import operator
import warnings

import torch
import torch.distributed as dist

from muond import qkv_split as _qkv_split
from muond.torch import collective as _collective
from muond.torch import groups as _groups
from muond.torch import placement as _placement
from muond.torch.optimizer import Muon

_TP_MODES = ("blockwise", "duplicated", "distributed", "auto")


def tp_partition_dim(p: torch.Tensor) -> int | None:
    """The dim TP splits ``p`` along, or None when ``p`` is replicated
    across TP: ``partition_dim`` counts only when ``tensor_model_parallel``
    is set (Megatron stamps partition_dim on duplicated weights too)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    dim = int(getattr(p, "partition_dim", -1))
    return dim if dim in (0, 1) else None


def group_coordinate(group, what: str = "process group") -> tuple[int, int]:
    """(size, this rank's index) of a process group; None is (1, 0): no
    group, as in Megatron's LayerShardedMuon (never torch's default group).
    TypeError naming ``what`` for anything else."""
    if group is None:
        return 1, 0
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what} must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


def _home_index(value, what: str) -> int:
    """An NS home coordinate: an int (numpy ints too; no bool in any form,
    as every muond option: groups.is_bool), else ValueError."""
    if not _groups.is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{what} must be an int, got {value!r}")


def replica_group(pg_collection, expert: bool):
    """The process group over which a param is replicated, from Megatron's
    pg_collection (dense: ``dp_cp``, else ``dp``; experts: ``expt_dp``), or
    None (no pg_collection: the seed's domain has no DP axis)."""
    if pg_collection is None:
        return None
    for name in (("expt_dp",) if expert else ("dp_cp", "dp")):
        group = getattr(pg_collection, name, None)
        if group is not None:
            return group
    return None


def domain_members(groups) -> tuple[int, ...]:
    """The global ranks of the grid that ``groups`` (ProcessGroups or None)
    span around this rank: gathered over each group in turn, so every rank
    of the grid gets the same ranks and the ranks of another grid (another
    pipeline stage, expert-parallel rank or TP group) others. A collective
    over each group: every member calls it."""
    members = {dist.get_rank() if dist.is_initialized() else 0}
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sorted(members), group=group)
        members = {r for ranks in gathered for r in ranks}
    return tuple(sorted(members))


def domain_name(kind: str, members) -> str:
    """A domain's name from its ranks: the same on each of them, another
    for any other set of ranks."""
    digest = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:12]
    return f"megatron-{kind}-{len(members)}r-{digest}"


def _agree_on_groups(indices: list, rank: int) -> None:
    """ValueError on every rank when the ranks remap different param groups
    (each rank's own mapping may be valid and still not match its peers')."""
    every = _collective.all_gather_object(indices)
    if any(other != indices for other in every):
        detail = ", ".join(f"rank {r}: {groups}" for r, groups in enumerate(every))
        raise ValueError("set_group_process_groups: every rank must remap the same param "
                         f"groups, together ({detail})")


def check_pg_collection(pg_collection) -> None:
    """TypeError unless ``pg_collection`` is None or Megatron-Core's
    ProcessGroupCollection (a dict or other object would read as no
    groups at all, silently)."""
    if pg_collection is None:
        return
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415
    except ImportError:
        ProcessGroupCollection = None  # noqa: N806 (any object with the fields)
    if (ProcessGroupCollection is not None
            and not isinstance(pg_collection, ProcessGroupCollection)) or isinstance(
                pg_collection, (dict, list, tuple, str)):
        raise TypeError("pg_collection must be Megatron-Core's ProcessGroupCollection or None, "
                        f"got {type(pg_collection).__name__}")


def _is_main_param(p) -> bool:
    """An fp32 main param of Megatron's mixed-precision wrapper: a plain
    tensor (``param.detach().clone().float()``: requires_grad False), never
    a model's Parameter. Megatron's Muon steps every param that has a grad;
    muond skips one that does not require grad (a frozen model param), so
    such a tensor is marked as requiring grad at registration (it is never
    in a forward)."""
    return not isinstance(p, torch.nn.Parameter) and p.is_leaf


class LayerShardedMuon(Muon):
    """Muon with layer sharding over the GTP_remat x TP domain, on muond
    daemons: the seed's constructor (argument names, defaults and meanings,
    docs/megatron.md; ``ns_batch_size`` defaults to muond's 0, auto batching
    by shape, where the seed's is 1) over ``muond.torch.Muon``.

    * ``gtp_remat_group`` / ``tp_group`` (None: no group, size 1) give the
      domain's sizes and this rank's (g, t); ``pg_collection`` supplies
      ``tp`` / ``gtp_remat`` when they are not given, and ``expt_tp`` /
      ``expt_gtp_remat`` for a param group whose params all carry
      ``expert_tp`` (MoE experts, as Megatron's TensorParallelMuon picks).
    * A param with ``main_grad`` (Megatron DDP's fp32 grad buffer) is stepped
      with it, cast to the param's dtype when they differ; its ``.grad`` is
      None again after the step, as Megatron's DDP hooks expect.
    * NS homes are the coordinator's (balanced by ns_cost over the whole
      job); ``set_param_ns_homes`` checks the mapping it is given and keeps
      it in ``param_ns_homes``. ``set_group_process_groups`` places a param
      group in the domain of its own process groups.
    * ``tp_mode``: each of the seed's four values is accepted ("blockwise"
      under TP warns); muond always runs the layer-sharded path (full-matrix
      Newton-Schulz, duplicated mode's result), which in the seed ignores
      tp_mode too. ``concurrent_groups`` must stay True (the daemon's lanes
      run disjoint domains at once).
    * An fp32 main param of Megatron's mixed-precision wrapper (a plain
      tensor, requires_grad False) that has a grad is stepped, as Megatron's
      Muon steps it.
    * Registration happens at the first step or state access, after
      Megatron's mixed-precision wrapper has put its fp32 main params in the
      groups (Float16OptimizerWithFloat16Params replaces them after
      construction).

    Every other keyword is ``muond.torch.Muon``'s (daemons, job_id,
    state_dtype, name, ...).
    """

    registers_at_construction = False

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95,
                 weight_decay: float = 0.01, *, nesterov: bool = True,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic",
                 num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, gtp_remat_group=None, tp_group=None,
                 ns_batch_size: int = 0, use_syrk: bool = False,
                 concurrent_groups: bool = True, use_decoupled_weight_decay: bool = True,
                 split_qkv: bool = False, is_qkv_fn=None, qkv_split_shapes=None,
                 pg_collection=None, tp_mode: str = "duplicated", **muond_options):
        if tp_mode not in _TP_MODES:
            raise ValueError(f"tp_mode={tp_mode!r}: the seed's values are {_TP_MODES}")
        check_pg_collection(pg_collection)
        if pg_collection is not None:
            gtp_remat_group = gtp_remat_group or getattr(pg_collection, "gtp_remat", None)
            tp_group = tp_group or getattr(pg_collection, "tp", None)
        self.gtp_remat_group, self.tp_group, self.pg_collection = (gtp_remat_group, tp_group,
                                                                   pg_collection)
        self.tp_mode = tp_mode
        gtp_size, g = group_coordinate(gtp_remat_group, "gtp_remat_group")
        tp_size, t = group_coordinate(tp_group, "tp_group")
        if tp_mode == "blockwise" and tp_size > 1:
            warnings.warn(
                "tp_mode='blockwise' (OptimizerConfig.muon_tp_mode's default): Megatron's "
                "TensorParallelMuon then orthogonalises each TP shard on its own; muond runs "
                "the layer-sharded path, Newton-Schulz on the full matrix (tp_mode="
                "'duplicated''s update), so the updates differ from a blockwise run "
                "(docs/megatron.md)", stacklevel=2)
        dp_group = replica_group(pg_collection, expert=False)
        dp_size, dp = group_coordinate(dp_group, "pg_collection's DP group")
        members = domain_members((gtp_remat_group, tp_group, dp_group))
        grid = dict(gtp_size=gtp_size, g=g, tp_size=tp_size, t=t, dp_size=dp_size, dp_rank=dp,
                    domain_name=domain_name("dense", members))
        grid.update({k: muond_options.pop(k) for k in list(grid) if k in muond_options})
        self.param_ns_homes: dict[int, tuple[int, int]] = {}
        self._group_process_groups: dict[int, tuple] = {}
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                         nesterov=nesterov, ns_steps=num_ns_steps,
                         fp32_matmul_prec=fp32_matmul_prec, coefficient_type=coefficient_type,
                         scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                         ns_batch_size=ns_batch_size, use_syrk=use_syrk,
                         concurrent_groups=concurrent_groups,
                         use_decoupled_weight_decay=use_decoupled_weight_decay,
                         split_qkv=split_qkv, is_qkv_fn=is_qkv_fn,
                         qkv_split_shapes=qkv_split_shapes, **grid, **muond_options)
        if hasattr(self._layout, "group_options"):
            # Every param is in the groups' domain, tagged or not (a plain
            # param would otherwise be taken for a DDP replica of the world).
            self._layout.options.given_grid = True
            self._layout.own_domains = True
        if pg_collection is not None:
            self._place_expert_groups(pg_collection)

    def _ensure_registered(self) -> None:
        """As muond.torch.Muon's, but Megatron's fp32 main params are marked
        as requiring grad first (``_is_main_param``), and split_qkv with no
        param is_qkv_fn picks (Megatron's expert bucket, built with the dense
        bucket's options) is no split, as Megatron's TensorParallelMuon
        treats it."""
        if self._pending_registration is not None:
            for group in self.param_groups:  # the groups as registered: once
                for p in group["params"]:
                    if not p.requires_grad and _is_main_param(p):
                        p.requires_grad_(True)
        if self._pending_registration is not None and self._qkv.split is not None:
            pick = self._qkv.is_qkv_fn
            if not any(p.ndim == 2 and pick(p) for group in self.param_groups
                       for p in group["params"]):
                self._qkv = _qkv_split.Choice()
        super()._ensure_registered()

    # -- the seed's setters ------------------------------------------------
    def set_param_ns_homes(self, param_ns_homes: dict) -> None:
        """Checks ``{id(param): (g_home, t_home)}`` (every key a param of
        this optimizer, every home two ints inside its group's domain) and
        keeps it in ``param_ns_homes``; a bad entry is a ValueError naming
        the param and the rule, and changes nothing. muond's coordinator
        picks the homes itself, balanced by ns_cost over the whole job (and
        re-balanced from measured NS times), so these do not move any NS."""
        where = {}
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                where[id(p)] = (f"param {i} of param group {gi}", self._group_grid(gi))
        if not isinstance(param_ns_homes, dict):
            raise ValueError("set_param_ns_homes takes a dict {id(param): (g_home, t_home)}, "
                             f"got {type(param_ns_homes).__name__}")
        checked = {}
        for key, home in param_ns_homes.items():
            if key not in where:
                raise ValueError(f"set_param_ns_homes: key {key!r} is not id() of a param of "
                                 "this optimizer")
            label, (G, T) = where[key]
            if not isinstance(home, (tuple, list)) or len(home) != 2:
                raise ValueError(f"set_param_ns_homes: {label}: its home must be a pair "
                                 f"(g_home, t_home), got {home!r}")
            g_home = _home_index(home[0], f"set_param_ns_homes: {label}: g_home")
            t_home = _home_index(home[1], f"set_param_ns_homes: {label}: t_home")
            if not (0 <= g_home < G and 0 <= t_home < T):
                raise ValueError(f"set_param_ns_homes: {label}: home {(g_home, t_home)} is "
                                 f"outside its (gtp_remat, tp) domain of size ({G}, {T})")
            checked[key] = (g_home, t_home)
        self.param_ns_homes = checked

    def set_group_process_groups(self, group_process_groups: dict) -> None:
        """Places param group ``i`` in the domain of its own
        ``(gtp_remat_group, tp_group)`` (either None: size 1), e.g. MoE
        experts over the expert groups; groups not named keep the
        constructor's. Every rank calls it together. After the first step
        the params are registered again with their state (as
        add_param_group), and a refusal on any rank (a bad index or group)
        is raised on every rank before anything changes (so is step()'s check
        of the registered groups: a changed fixed entry)."""
        def checked_pairs():
            if self._pending_registration is None:
                self._check_registered_groups()
            return self._checked_group_pairs(group_process_groups)

        # Before any group's collective: the same refusal, and the same groups
        # remapped, on every rank.
        pairs = self._checked_on_every_rank("set_group_process_groups", checked_pairs)
        if self._layout.collective:
            _agree_on_groups(sorted(pairs), self._rank)
        # The new domains (collectives over each group, in the same order on
        # every rank), then the placement changed and, once registered,
        # every param registered again with its state (undone on failure).
        new = {gi: self._grid_options(*pairs[gi], None, f"group{gi}") for gi in sorted(pairs)}
        old = dict(self._layout.group_options)

        def change():
            self._layout.group_options.update(new)

        def undo():
            self._layout.group_options.clear()
            self._layout.group_options.update(old)

        if self._pending_registration is None:
            self._register_again(change, undo, "set_group_process_groups")
        else:
            change()
        self._group_process_groups.update(pairs)

    def _checked_group_pairs(self, group_process_groups) -> dict:
        """{param group index: (gtp_remat_group, tp_group)} of the mapping,
        every entry checked (TypeError / ValueError naming it) without any
        communication."""
        if not isinstance(group_process_groups, dict):
            raise TypeError("set_group_process_groups takes a dict {param group index: "
                            "(gtp_remat_group, tp_group)}, got "
                            f"{type(group_process_groups).__name__}")
        if not hasattr(self._layout, "group_options"):
            raise ValueError("set_group_process_groups needs local mode (one trainer per "
                             f"daemon); this optimizer runs shard_mode={self.shard_mode!r}")
        pairs = {}
        for gi, pair in group_process_groups.items():
            if isinstance(gi, bool) or not isinstance(gi, int) or not (
                    0 <= gi < len(self.param_groups)):
                raise ValueError(f"set_group_process_groups: {gi!r} is not a param group index "
                                 f"(this optimizer has {len(self.param_groups)} groups)")
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"set_group_process_groups: group {gi} needs "
                                 f"(gtp_remat_group, tp_group), got {pair!r}")
            for group, role in zip(pair, ("gtp_remat_group", "tp_group")):
                group_coordinate(group, f"set_group_process_groups: group {gi}: {role}")
            pairs[gi] = tuple(pair)
        return pairs

    # -- Megatron's grads --------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Megatron DDP's ``main_grad`` is the grad of a param that has one
        (class docstring); then muond.torch.Muon's step. Registers first
        (every rank together), then checks every main_grad before any is
        used: a bad one is a ValueError naming the param, and the other
        ranks' step fails at once naming this rank (Muon's trainer refusal)."""
        self._ensure_registered()
        with self._refused_on_every_rank():  # the peers fail this step at once too
            fed = self._main_grads()
        for p, grad in fed:
            p.grad = grad
        try:
            return super().step(closure, **kwargs)
        finally:
            for p, _ in fed:
                p.grad = None

    def _main_grads(self) -> list:
        """(param, the grad its main_grad gives) for every param that has a
        main_grad; ValueError naming the param when one cannot be its grad."""
        out = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                main_grad = getattr(p, "main_grad", None)
                if main_grad is None:
                    continue
                name = self._param_names.get(id(p), f"param {i} of param group {gi}")
                rule = None
                if not isinstance(main_grad, torch.Tensor):
                    rule = f"is a {type(main_grad).__name__}, not a tensor"
                elif not main_grad.is_floating_point():
                    rule = f"has dtype {main_grad.dtype}; a grad is floating point"
                elif tuple(main_grad.shape) != tuple(p.shape):
                    rule = (f"has shape {tuple(main_grad.shape)}, the param "
                            f"{tuple(p.shape)}")
                elif main_grad.device != p.device:
                    rule = f"is on {main_grad.device}, the param on {p.device}"
                if rule is not None:
                    raise ValueError(f"param {name}: its main_grad {rule}")
                out.append((p, main_grad if main_grad.dtype == p.dtype
                            else main_grad.to(p.dtype)))
        return out

    # -- per-group domains -------------------------------------------------
    def _group_grid(self, gi: int) -> tuple[int, int]:
        """(G, T) of param group ``gi``'s domain."""
        own = getattr(self._layout, "group_options", {}).get(gi)
        return (own.gtp_size, own.tp_size) if own is not None else (self.gtp_size, self.tp_size)

    def _grid_options(self, gtp_group, tp_group, dp_group, kind: str):
        """placement.Options of a domain of its own (local mode): the grid
        of the groups, named by its ranks (a collective over each group)."""
        gtp_size, g = group_coordinate(gtp_group, "gtp_remat_group")
        tp_size, t = group_coordinate(tp_group, "tp_group")
        dp_size, dp = group_coordinate(dp_group, "the DP group")
        base = self._layout.options
        return _placement.Options(
            rank=base.rank, world=base.world,
            domain=domain_name(kind, domain_members((gtp_group, tp_group, dp_group))),
            gtp_size=gtp_size, tp_size=tp_size, g=g, t=t, dp_size=dp_size, dp_rank=dp,
            given_grid=True)

    def _place_expert_groups(self, pg_collection) -> None:
        """A param group whose params all carry ``expert_tp`` goes to the
        expert groups' domain (Megatron's TensorParallelMuon takes
        pg_collection.expt_tp for such params)."""
        expt_tp = getattr(pg_collection, "expt_tp", None)
        expt_gtp = getattr(pg_collection, "expt_gtp_remat", None)
        group_coordinate(expt_tp, "pg_collection.expt_tp")
        group_coordinate(expt_gtp, "pg_collection.expt_gtp_remat")
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            if params and all(getattr(p, "expert_tp", False) for p in params):
                if not hasattr(self._layout, "group_options"):
                    raise ValueError("expert params under pg_collection need local mode (one "
                                     "trainer per daemon); this optimizer runs "
                                     f"shard_mode={self.shard_mode!r}")
                self._layout.group_options[gi] = self._grid_options(
                    expt_gtp, expt_tp, replica_group(pg_collection, expert=True), "expert")
