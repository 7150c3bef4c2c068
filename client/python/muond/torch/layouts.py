"""One layout strategy per placement mode (``shard_mode``): where each param
of the optimizer goes, on which daemons, as which wire groups.

* ``SplitPlacement`` (``"split"``): one trainer, G x T daemons; every Muon
  weight that splits is sharded over them as strided views of one buffer
  (muond.split), everything else goes whole to the least loaded daemon in
  its own 1x1 domain ``solo-r<rank>``.
* ``LocalPlacement`` (``"local"``): one trainer per daemon; each param's
  domain and coordinates come from muond.torch.placement, agreed with the
  other ranks under torch.distributed before any RPC.

Both take a ``PlacementRun`` (the params to place, the shared memory, the
wire groups being built) and answer every daemon's wire groups."""
from __future__ import annotations

from muond import batched as _batched
from muond import qkv_split as _qkv_split
from muond import split as _split
from muond import state as _state
from muond._dtensor import is_dtensor
from muond.torch import placement as _placement
from muond.torch import qkv_placement as _qkv_placement
from muond.torch import wire as _wire
from muond.torch.collective import all_gather_object
from muond.v1 import muond_pb2 as pb


class PlacementRun:
    """One placement of every param: ``collect()`` checks and lists them
    (muond.torch.groups.collect_params), ``memory`` (SharedParams) receives
    their buffers; the run records each param's layout (a SplitLayout,
    ("solo", rank) or "local"), the daemons holding it, each daemon's
    (group index, wire group name) pairs, each batched param's matrices
    (muond.batched) and, in local mode, the places (by wire name)."""

    def __init__(self, collect, memory, daemons: int, split_of=None):
        self._collect = collect
        # (group, param, name) -> its muond.qkv_split.RowSplit, or None.
        self.split_of = split_of or (lambda group, p, name: None)
        self.collected = None
        self.memory = memory
        self.wire: list[dict[str, pb.ParamGroup]] = [dict() for _ in range(daemons)]
        self.wire_groups: dict[int, list[tuple[int, str]]] = {}
        self.layouts: dict[str, object] = {}
        self.ranks_of: dict[str, tuple[int, ...]] = {}
        self.places: dict | None = None
        # A batched Muon param's name -> ((matrix wire name, its daemon), ...).
        self.matrices: dict[str, tuple] = {}

    def params(self) -> list:
        """(group index, group name, group, param name, param) of every param
        with elements. A param without any (torch.optim steps it as a no-op)
        goes to no daemon: layout EMPTY, its state kept by none."""
        self.collected = self._collect()
        todo, empty = [], []
        for item in self.collected.todo:
            name, p = item[3], item[4]
            if p.numel() > 0:
                todo.append(item)
                continue
            self.layouts[name], self.ranks_of[name] = _state.EMPTY, ()
            empty.append(f"{name} {tuple(p.shape)}")
            if not is_dtensor(p):  # zero_grad and the grad copy treat it as any param
                self.memory.rebind(p, 0)
        if empty and not todo:
            raise ValueError(
                f"muond.torch.Muon: no param has elements ({', '.join(empty[:5])}"
                f"{', ...' if len(empty) > 5 else ''}): there is nothing for the daemons to "
                "step; give the optimizer at least one param with elements (empty ones "
                "beside it step as no-ops, as in torch.optim)")
        return todo

    def group(self, rank: int, gi: int, wname: str, group: dict, domain) -> pb.ParamGroup:
        """Daemon `rank`'s wire group `wname`, made at its first param with
        the group's registered hyperparameters."""
        if wname not in self.wire[rank]:
            wg = pb.ParamGroup(name=wname, domain=domain)
            _wire.set_hyperparams(wg, {**group, **self.collected.live[gi]})
            self.wire[rank][wname] = wg
            self.wire_groups.setdefault(rank, []).append((gi, wname))
        return self.wire[rank][wname]

    def record_batch(self, name: str, layout) -> None:
        """A batched param's layout, daemons and matrices."""
        self.layouts[name] = layout
        self.ranks_of[name] = tuple(sorted(layout.ranks()))
        self.matrices[name] = tuple((m.name, m.rank) for m in layout.matrices)

    def per_rank(self) -> list[list[pb.ParamGroup]]:
        """Every daemon's wire groups, their memory allocated (placement done)."""
        groups = [list(w.values()) for w in self.wire]
        self.memory.allocate(groups)
        return groups


class SplitPlacement:
    """Split mode: one trainer's full weights over G x T daemons."""
    mode = "split"
    collective = False

    def __init__(self, gtp_size, tp_size, domain_name: str):
        # The sizes as given are checked against the daemons before they are
        # read as ints, so 2.9 or "2" is refused rather than truncated.
        self._given = (gtp_size, tp_size)
        self.domain_name = domain_name

    @property
    def gtp_size(self) -> int:
        return int(self._given[0])

    @property
    def tp_size(self) -> int:
        return int(self._given[1])

    def check_daemons(self, count: int) -> None:
        gtp_size, tp_size = self._given
        if count != gtp_size * tp_size:
            raise ValueError(f"split mode needs gtp_size x tp_size = {gtp_size} x "
                             f"{tp_size} daemons, got {count}")

    def place(self, run: PlacementRun, refusal: BaseException | None = None):
        todo = run.params()
        n = len(run.wire)
        muon_load, adamw_load = [0] * n, [0] * n
        for gi, gname, group, name, p in todo:
            algorithm = group["algorithm"]
            if is_dtensor(p):
                raise ValueError(f"param {name} is a DTensor: split mode shards full weights "
                                 "of one trainer; DTensor params (FSDP2, TP) need "
                                 "shard_mode='local' (the default without daemons=)")
            if algorithm == "muon" and _batched.is_batched(p.shape):
                self._place_batch(run, gi, gname, group, name, p, muon_load)
                continue
            split = run.split_of(group, p, name)
            if split is not None:
                self._place_split(run, gi, gname, group, name, p, split, muon_load)
                continue
            layout = None
            if algorithm == "muon":
                preferred = (int(getattr(p, "partition_dim", 0))
                             if getattr(p, "tensor_model_parallel", False) else None)
                layout = _split.plan_split(tuple(p.shape), self.gtp_size, self.tp_size,
                                           preferred)
            if layout is not None:
                self._place_sharded(run, gi, gname, group, name, p, layout)
            else:
                load = muon_load if algorithm == "muon" else adamw_load
                rank = min(range(n), key=lambda r: (load[r], r))
                load[rank] += (_split.ns_cost(tuple(p.shape)) if algorithm == "muon"
                               else p.numel())
                self._place_solo(run, gi, gname, group, name, p, rank)
        return run.per_rank()

    def _place_sharded(self, run, gi, gname, group, name, p, layout):
        pbuf, gbuf = run.memory.rebind(p, layout.buffer_numel)
        run.layouts[name] = layout
        run.ranks_of[name] = tuple(sorted({s.rank for s in layout.shards}))
        tags = pb.ShardTags(tensor_model_parallel=layout.tp_sharded,
                            partition_dim=layout.tp_dim or 0,
                            is_gtp_weight_remat=layout.gtp_sharded,
                            pad_length=layout.pad_length)
        for s in layout.shards:
            domain = pb.Domain(name=self.domain_name, gtp_size=self.gtp_size,
                               tp_size=self.tp_size, g=s.g, t=s.t)
            wg = run.group(s.rank, gi, gname, group, domain)
            wg.params.append(pb.Param(name=name, full_shape=list(layout.full_shape),
                                      param=pbuf.ref(s.offset, s.shape, s.strides),
                                      grad=gbuf.ref(s.offset, s.shape, s.strides), tags=tags))

    @staticmethod
    def _place_batch(run, gi, gname, group, name, p, muon_load):
        """A batched Muon param: its matrices, the param one buffer (the
        matrices its contiguous slices)."""
        pbuf, gbuf = run.memory.rebind(p, p.numel())
        rows, cols = (int(s) for s in p.shape[-2:])
        shapes = [(_batched.matrix_name(name, index), rows, cols)
                  for index in _batched.batch_indices(p.shape[:-2])]
        matrices = SplitPlacement._place_matrices(run, gi, gname, group, shapes, pbuf, gbuf,
                                                  muon_load)
        run.record_batch(name, _batched.BatchLayout(matrices))

    @staticmethod
    def _place_split(run, gi, gname, group, name, p, split, muon_load):
        """A split QKV param: its matrices over a staging copy of the param's
        rows (muond.qkv_split)."""
        cols = int(p.shape[1])
        chosen = _qkv_split.selections(name, int(p.shape[0]), split)
        perm = [r for _, rows in chosen for r in rows]
        pbuf, gbuf = run.memory.bind_permuted(p, perm)
        shapes = [(wname, len(rows), cols) for wname, rows in chosen]
        matrices = SplitPlacement._place_matrices(run, gi, gname, group, shapes, pbuf, gbuf,
                                                  muon_load)
        run.record_batch(name, _batched.BatchLayout(matrices, tuple(perm)))

    @staticmethod
    def _place_matrices(run, gi, gname, group, shapes, pbuf, gbuf, muon_load) -> tuple:
        """Each (wire name, rows, cols) matrix, contiguous one after another
        in the param's spans, whole on the daemon with the least NS cost so
        far (as a 2-D param too small to split); their muond.batched.Matrix."""
        matrices, offset = [], 0
        for wname, rows, cols in shapes:
            rank = min(range(len(muon_load)), key=lambda r: (muon_load[r], r))
            muon_load[rank] += _split.ns_cost((rows, cols))
            domain = pb.Domain(name=f"solo-r{rank}", gtp_size=1, tp_size=1, g=0, t=0)
            wg = run.group(rank, gi, f"{gname}.solo-r{rank}", group, domain)
            shape, strides = [rows, cols], [cols, 1]
            wg.params.append(pb.Param(name=wname, full_shape=shape,
                                      param=pbuf.ref(offset, shape, strides),
                                      grad=gbuf.ref(offset, shape, strides),
                                      tags=pb.ShardTags()))
            matrices.append(_batched.Matrix(wname, offset, (rows, cols), ("solo", rank)))
            offset += rows * cols
        return tuple(matrices)

    @staticmethod
    def _place_solo(run, gi, gname, group, name, p, rank):
        pbuf, gbuf = run.memory.rebind(p, p.numel())
        run.layouts[name] = ("solo", rank)
        run.ranks_of[name] = (rank,)
        shape, strides = _wire.whole(p)
        domain = pb.Domain(name=f"solo-r{rank}", gtp_size=1, tp_size=1, g=0, t=0)
        # A group name names one domain on the wire (the coordinator checks that
        # every rank holding it agrees), so each daemon's 1x1 group is its own.
        wname = f"{gname}.solo-r{rank}"
        wg = run.group(rank, gi, wname, group, domain)
        wg.params.append(pb.Param(name=name, full_shape=_wire.full_shape(p.shape),
                                  param=pbuf.ref(0, shape, strides),
                                  grad=gbuf.ref(0, shape, strides), tags=pb.ShardTags()))


class LocalPlacement:
    """Local mode: one trainer per daemon (torchrun / Megatron ranks)."""
    mode = "local"

    def __init__(self, rank: int, world: int, domain_name: str, gtp_size: int,
                 tp_size: int, g: int, t: int, dp_size: int | None, dp_rank: int | None):
        self.rank, self.world = rank, world
        self.options = _placement.Options(
            rank=rank, world=world, domain=domain_name, gtp_size=gtp_size, tp_size=tp_size,
            g=g, t=t, dp_size=dp_size, dp_rank=dp_rank,
            given_grid=gtp_size * tp_size > 1 or g != 0 or t != 0)
        # param group index -> placement.Options of a group placed in a
        # domain of its own (muond.megatron.LayerShardedMuon's
        # set_group_process_groups); other groups take self.options.
        self.group_options: dict = {}
        # True: every group's wire name carries its domain, also in the
        # default domain (muond.megatron: domains named by their ranks differ
        # between the ranks of one param group).
        self.own_domains = False

    @property
    def collective(self) -> bool:
        """Placement is agreed with the other ranks (torch.distributed with
        world > 1)."""
        return self.world > 1

    @staticmethod
    def check_daemons(count: int) -> None:
        if count != 1:
            raise ValueError(f"local mode talks to one daemon, got {count}")

    def place(self, run: PlacementRun, refusal: BaseException | None = None):
        """In a collective placement everything that may refuse, including
        ``refusal`` (this rank's daemon not healthy), runs inside
        muond.torch.placement.settle, so one rank's refusal stops all."""
        if self.collective:
            todo = []

            def compute():
                if refusal is not None:
                    raise refusal
                todo.extend(run.params())
                return self._compute_places(run, todo)

            run.places = _placement.settle(compute, self.rank, self.world, all_gather_object,
                                           dp_given=self.options.dp_size is not None)
        else:
            todo = run.params()
            run.places = self._compute_places(run, todo)
        for gi, gname, group, name, p in todo:
            self._place_one(run, gi, gname, group, name, p)
        return run.per_rank()

    def _compute_places(self, run, todo) -> dict:
        """This rank's place of every param (no communication)."""
        requests = [_placement.Request(name, p, group["algorithm"],
                                       run.split_of(group, p, name),
                                       self.group_options.get(gi) or (
                                           self.options if self.own_domains else None))
                    for gi, _, group, name, p in todo]
        return _placement.place_params(requests, self.options)

    @staticmethod
    def _place_one(run, gi, gname, group, name, p):
        if group["algorithm"] == "muon" and _batched.is_batched(p.shape):
            LocalPlacement._place_batch(run, gi, gname, group, name, p)
            return
        split = run.split_of(group, p, name)
        if split is not None:
            LocalPlacement._place_split(run, gi, gname, group, name, p, split)
            return
        place = run.places[name]
        run.layouts[name] = "local"
        run.ranks_of[name] = (0,)
        if is_dtensor(p):
            pbuf, gbuf, local = run.memory.bind_dtensor(p)
            shape, strides = _wire.whole(local)
        else:
            pbuf, gbuf = run.memory.rebind(p, p.numel())
            shape, strides = _wire.whole(p)
        wg = LocalPlacement._wire_group(run, gi, gname, group, place, p)
        wg.params.append(pb.Param(name=name, full_shape=_wire.full_shape(place.full_shape),
                                  param=pbuf.ref(0, shape, strides),
                                  grad=gbuf.ref(0, shape, strides),
                                  tags=LocalPlacement._tags(place, p)))

    @staticmethod
    def _place_batch(run, gi, gname, group, name, p):
        """A batched Muon param: one wire param per matrix, each a view of
        the param's memory (or its local shard) at its place's offset."""
        if is_dtensor(p):
            pbuf, gbuf, _ = run.memory.bind_dtensor(p)
        else:
            pbuf, gbuf = run.memory.rebind(p, p.numel())
        matrices = []
        for index in _batched.batch_indices(p.shape[:-2]):
            wname = _batched.matrix_name(name, index)
            place = run.places[wname]
            shape = list(place.local_shape)
            strides = [shape[1], 1]
            wg = LocalPlacement._wire_group(run, gi, gname, group, place, p)
            wg.params.append(pb.Param(name=wname, full_shape=list(place.full_shape),
                                      param=pbuf.ref(place.offset, shape, strides),
                                      grad=gbuf.ref(place.offset, shape, strides),
                                      tags=LocalPlacement._tags(place, p)))
            matrices.append(_batched.Matrix(wname, place.offset, tuple(shape), "local"))
        run.record_batch(name, _batched.BatchLayout(tuple(matrices)))

    @staticmethod
    def _place_split(run, gi, gname, group, name, p, split):
        """A split QKV param: one wire param per matrix over a staging copy of
        the param's local rows (muond.torch.qkv_placement)."""
        places, perm = _qkv_placement.split_places(name, run.places[name], split)
        pbuf, gbuf = run.memory.bind_permuted(p, perm)
        matrices = []
        for wname, place in places.items():
            shape, strides = list(place.local_shape), [place.local_shape[1], 1]
            wg = LocalPlacement._wire_group(run, gi, gname, group, place, p)
            wg.params.append(pb.Param(name=wname, full_shape=list(place.full_shape),
                                      param=pbuf.ref(place.offset, shape, strides),
                                      grad=gbuf.ref(place.offset, shape, strides),
                                      tags=LocalPlacement._tags(place, p)))
            matrices.append(_batched.Matrix(wname, place.offset, tuple(shape), "local"))
        run.record_batch(name, _batched.BatchLayout(tuple(matrices), tuple(perm)))

    @staticmethod
    def _tags(place, p) -> pb.ShardTags:
        if place.kind in ("dtensor", "ddp", "solo"):
            return pb.ShardTags(tensor_model_parallel=place.tp_dim is not None,
                                partition_dim=place.tp_dim or 0,
                                is_gtp_weight_remat=place.gtp_sharded,
                                pad_length=place.pad_length, gtp_rows=list(place.gtp_rows))
        # Megatron tags, as given.
        return pb.ShardTags(tensor_model_parallel=bool(getattr(p, "tensor_model_parallel",
                                                               False)),
                            partition_dim=int(getattr(p, "partition_dim", 0)),
                            is_gtp_weight_remat=place.gtp_sharded,
                            pad_length=place.pad_length, gtp_rows=list(place.gtp_rows))

    @staticmethod
    def _wire_group(run, gi, gname, group, place, p) -> pb.ParamGroup:
        """The wire group of a param at ``place``: a group's params may live
        in several domains (meshes), and one wire group names one domain, so
        one wire group per domain, named the same on every rank (a Megatron
        param's is the group's own name, unless its group has a domain of
        its own: placement.ParamPlace.own_domain)."""
        if place.kind in ("dtensor", "ddp", "solo") or place.own_domain:
            wname = f"{gname}{'.' if place.kind == 'solo' else '@'}{place.domain}"
        else:
            wname = gname
        domain = pb.Domain(name=place.domain, gtp_size=place.G, tp_size=place.T, g=place.g,
                           t=place.t, dp_size=place.D if place.D > 1 else 0,
                           d=place.d if place.D > 1 else 0)
        return run.group(0, gi, wname, group, domain)


def strategy(shard_mode: str, *, rank: int, world: int, domain_name: str, gtp_size: int,
             tp_size: int, g: int, t: int, dp_size, dp_rank):
    """The layout strategy of `shard_mode`, else ValueError."""
    if shard_mode == "split":
        return SplitPlacement(gtp_size, tp_size, domain_name)
    if shard_mode == "local":
        return LocalPlacement(rank, world, domain_name, int(gtp_size), int(tp_size), g, t,
                              dp_size, dp_rank)
    raise ValueError(f"shard_mode {shard_mode!r} not in ('split', 'local')")
