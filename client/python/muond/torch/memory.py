"""Memory the daemons can map: every param (and, apart, every grad) packed
into a few flat buffers, one POSIX shm object (CPU, muond.shm) per dtype or
one cudaMalloc shared by IPC handle per (dtype, device; muond.torch.cuda_memory:
freed at the optimizer's end, unlike torch's own shared blocks), the way DDP and
Megatron keep flat buffers. Each buffer is declared once to a daemon as a
region and every tensor is a view at an aligned byte offset in it
(docs/ARCHITECTURE.md "Memory registration"): the open files of trainer and
daemon do not grow with the number of params. ``SharedParams`` owns one
optimizer's buffers and the per-step copies between the model's tensors and
them."""
from __future__ import annotations

import functools
import itertools
import logging
import math
import operator

import torch

from muond._dtensor import is_dtensor
from muond.shm import ShmBuffer, shm_name
from muond.torch import fsdp2_storage as _fsdp2
from muond.torch import wire as _wire
from muond.torch.cuda_memory import CUDA_IPC_HANDLE_SIZE, CudaAllocation  # noqa: F401
from muond.torch.tensor_layout import LayoutCache
from muond.v1 import muond_pb2 as pb

# Every view starts on this byte boundary of its buffer: a CUDA allocation's
# alignment (vector loads, cuBLAS) and a multiple of a host cache line.
ALIGN_BYTES = 256

# The per-step checks of the rebound params read one attribute of every param
# through these (map over a list runs the loop in C: ~50-100 ns a param, a
# Python loop with the same reads costs several times that).
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_IS_SET_TO = torch.Tensor.is_set_to  # the same storage, offset, size and stride
_IS_NONE = functools.partial(operator.is_, None)
_CONTIGUOUS = torch.Tensor.is_contiguous


class Regions:
    """The memory regions of one optimizer's buffers, one per distinct memory:
    an shm object, or a CUDA allocation (its IPC handle names it; a region
    covers the largest end any of its buffers reaches)."""

    def __init__(self):
        self._by_memory: dict = {}  # shm name | (device, handle) -> pb.MemoryRegion
        self._by_name: dict[str, pb.MemoryRegion] = {}

    def shm(self, buffer: ShmBuffer) -> str:
        region = pb.MemoryRegion(name=buffer.name, kind=pb.MEMORY_KIND_HOST_SHM,
                                 shm_name=buffer.name,
                                 byte_size=buffer.nbytes)
        return self._add(buffer.name, region).name

    def cuda(self, device: int, handle: bytes, end: int) -> str:
        """The region of the allocation behind `handle`, covering at least
        [0, end) bytes."""
        key = (device, handle)
        if key not in self._by_memory:
            self._add(key, pb.MemoryRegion(name=f"cuda{device}-{len(self._by_memory)}",
                                           kind=pb.MEMORY_KIND_CUDA_IPC, cuda_ipc_handle=handle,
                                           device=device))
        region = self._by_memory[key]
        region.byte_size = max(region.byte_size, end)
        return region.name

    def _add(self, key, region: pb.MemoryRegion) -> pb.MemoryRegion:
        self._by_memory[key] = region
        self._by_name[region.name] = region
        return region

    def used_by(self, groups) -> list[pb.MemoryRegion]:
        """The declarations of the regions `groups`' refs name, in first-use
        order (a daemon maps only the memory it is given views into)."""
        names = dict.fromkeys(ref.region for g in groups for prm in g.params
                              for ref in (prm.param, prm.grad))
        return [self._by_name[n] for n in names]


class Buffer:
    """One flat buffer of one dtype on one device holding many tensors (all
    params, or all grads, of that dtype and device). Filled in two phases:
    ``reserve`` hands out aligned element offsets while the params are
    placed, ``allocate`` then makes the memory once at its final size. An
    shm buffer's region is named from the start (the object gets that name);
    a CUDA buffer's is known only once allocated (the block it lands in), so
    until then its refs name it by ``key`` and ``SharedParams.allocate``
    rewrites them."""

    def __init__(self, job_id: str, key: str, dtype: torch.dtype, device: torch.device):
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"muond handles cpu and cuda tensors, got {device}")
        self.job_id, self.key, self.dtype, self.device = job_id, key, dtype, device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.numel = 0
        self.shm = None
        self.flat = None
        self.region = key if device.type == "cuda" else shm_name(job_id)
        self.base_offset = 0  # bytes from the region's start to flat[0]

    def reserve(self, numel: int) -> int:
        """The element offset of a fresh span of ``numel`` elements (0 is
        fine: an empty view), starting on an ALIGN_BYTES boundary."""
        align = ALIGN_BYTES // self.itemsize
        offset = -(-self.numel // align) * align
        self.numel = offset + numel
        return offset

    def allocate(self, regions: Regions) -> None:
        """The zero-filled memory (at least one element: a region is never
        empty) and its region."""
        numel = max(self.numel, 1)
        if self.device.type == "cuda":
            # Only the tensor keeps the allocation: it is freed once the
            # buffer and every view of it are gone (SharedParams.close).
            memory = CudaAllocation(self.device.index, numel * self.itemsize)
            self.flat = memory.tensor(self.dtype).zero_()
            self.region = regions.cuda(memory.device, memory.handle, memory.nbytes)
        else:
            self.shm = ShmBuffer(self.job_id, numel, self.dtype, name=self.region)
            self.flat = self.shm.flat
            self.region = regions.shm(self.shm)

    def view(self, offset: int, shape) -> torch.Tensor:
        """A contiguous tensor of ``shape`` at element ``offset`` (one
        as_strided: a slice then a view costs twice as much, and a
        registration makes two views per param)."""
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        return self.flat.as_strided(tuple(shape), tuple(reversed(strides)), offset)

    def ref(self, offset: int, shape, strides) -> pb.TensorRef:
        return pb.TensorRef(region=self.region,
                            byte_offset=self.base_offset + offset * self.itemsize,
                            dtype=_wire.DTYPES[self.dtype], shape=list(shape),
                            strides=list(strides))

    def release(self) -> None:
        """Unlinks the shm name (its mapping lives while a view does) and
        drops this buffer's own view of its memory."""
        if self.shm is not None:
            self.shm.unlink()
        self.shm = self.flat = None


class Slot:
    """A tensor's span in a Buffer: what placement sees of it. ``ref`` gives
    a view of the span (``offset`` elements into it: the strided shards of
    muond.split) as a TensorRef."""

    def __init__(self, buffer: Buffer, numel: int):
        self.buffer = buffer
        self.offset = buffer.reserve(numel)

    def ref(self, offset: int, shape, strides) -> pb.TensorRef:
        return self.buffer.ref(self.offset + offset, shape, strides)

    def view(self, shape) -> torch.Tensor:
        return self.buffer.view(self.offset, shape)


class SharedParams:
    """One optimizer's params in daemon-visible memory: the buffers, their
    regions (``close``, the optimizer's end, frees them), each rebound
    param's (param, shared view, address),
    each param's (param, shared grad) and each DTensor param's (param,
    shared param view, shared grad view).

    Placement asks for each param's slots (``rebind``, ``bind_dtensor``) and
    builds its refs from them; ``allocate`` then makes every buffer at its
    final size, moves the params in and points the refs at the regions.
    A placement that fails before ``allocate`` leaves the params untouched."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.buffers: list[Buffer] = []
        self.regions = Regions()
        self.grads: list = []
        self.views: list = []
        self.dtensors: list = []
        # FSDP2 params whose shard lives in the param buffer (fsdp2_storage):
        # (param, BoundShard); no param copy per step.
        self.fsdp_bound: list = []
        self._fsdp_params = None  # id(param) -> FSDPParam, during a placement
        self._to_bind_fsdp: list = []  # (param, FSDPParam, local, param slot, grad slot)
        self._unallocated: dict = {}  # (role, dtype, device) -> Buffer
        self._to_rebind: list = []  # (param, param slot, grad slot)
        self._to_copy: list = []  # (DTensor param, its local shard, param slot, grad slot)
        # A split QKV param's (param, staging param view, staging grad view,
        # perm): staging row i is the param's local row perm[i] (muond.qkv_split).
        self.permuted: list = []
        self._to_permute: list = []  # (param, its local tensor, param slot, grad slot, perm)
        self._index_rebound()

    def _index_rebound(self) -> None:
        """The rebound params (``grads`` and ``views`` list them in the same
        order) and what each step compares them with, as parallel lists: the
        per-step checks are a few passes in C over them (``grads_in_place``,
        ``rebound_intact``) instead of a Python loop per param."""
        self._rebound = [p for p, _ in self.grads]
        self.rebound_ids = frozenset(map(id, self._rebound))
        self._shared_grads = [grad for _, grad in self.grads]
        # Where each shared grad lives: the grad object is handed to the user
        # as .grad, who may move it in place (p.grad.data = x); an alias of
        # the span, never handed out, takes it back (rehome_grads).
        self._grad_homes = [grad.detach() for grad in self._shared_grads]
        self._ptrs = [ptr for _, _, ptr in self.views]
        self._shapes = [view.shape for _, view, _ in self.views]
        self._dtypes = [view.dtype for _, view, _ in self.views]
        self._frozen = None  # grads_in_place's requires_grad mask, when not all
        # The layouts the last passing checks found (tensor_layout).
        self._params_layout = LayoutCache()
        self._grads_layout = LayoutCache()
        self._frozen_skip_cache = None  # (that mask, frozen_skips' lists)

    def only_rebound(self) -> bool:
        """Every param is a rebound one (a plain tensor bound to its shared
        view): no DTensor, FSDP2 or split QKV param, whose values or grads
        step() copies in before each step."""
        return not (self.dtensors or self.fsdp_bound or self.permuted or self._to_permute)

    def first_grad_in_place(self) -> bool:
        """The first rebound param that requires grad has its shared grad as
        .grad: a check of one param (past any frozen ones before it) that
        tells a trainer whose zero_grad() sets the grads to None (backward
        then makes new ones) before grads_in_place's passes."""
        for p, grad in zip(self._rebound, self._shared_grads):
            if p.requires_grad:
                return p.grad is grad
        return True

    def grads_in_place(self) -> bool:
        """Every rebound param that requires grad has its shared grad as
        ``.grad`` (the usual step: backward accumulated there, or
        ``zero_grad(set_to_none=False)`` bound it, and the shared grad is
        still its span, as laid out at registration: none moved, re-strided
        or resized in place by ``p.grad.data = x``, ``p.grad.t_()``,
        ``p.grad.resize_(...)``), and every frozen one (requires_grad False:
        LoRA's base weights, a frozen embedding) has none: no grad to copy or
        re-point, every one dense, the frozen ones skipped
        (``frozen_skips``). Passes in C, whatever the mix."""
        ps, grads, homes = self._rebound, self._shared_grads, self._grad_homes
        # The usual step has no frozen param: no mask is built for it.
        self._frozen = (None if all(map(_REQUIRES_GRAD, ps))
                        else tuple(map(_REQUIRES_GRAD, ps)))
        if self._frozen is not None:
            wants = self._frozen
            ps = list(itertools.compress(self._rebound, wants))
            grads = list(itertools.compress(self._shared_grads, wants))
            homes = list(itertools.compress(self._grad_homes, wants))
            frozen = itertools.compress(self._rebound, map(operator.not_, wants))
            if not all(map(_IS_NONE, map(_GRAD, frozen))):
                return False
        if not all(map(operator.is_, map(_GRAD, ps), grads)):
            return False

        def at_home():
            return all(map(_IS_SET_TO, grads, homes))
        if self._frozen is None:  # all of them: their layout as last found
            return self._grads_layout.holds(grads, at_home)
        return at_home()

    def frozen_skips(self, names: dict, ranks_of: dict, daemons: int) -> list[list[str]]:
        """Per daemon, the names of the frozen params as grads_in_place last
        found them (in the order the per-param loop lists them), kept while
        the same params stay frozen."""
        if self._frozen is None:
            return [[] for _ in range(daemons)]
        cached = self._frozen_skip_cache
        if cached is None or cached[0] != self._frozen:
            skipped: list[list[str]] = [[] for _ in range(daemons)]
            for p, wants in zip(self._rebound, self._frozen):
                if not wants:
                    for rank in ranks_of[names[id(p)]]:
                        skipped[rank].append(names[id(p)])
            cached = self._frozen_skip_cache = (self._frozen, skipped)
        return [list(s) for s in cached[1]]

    def rehome_grads(self, names: dict | None) -> None:
        """Each shared grad the user moved or relaid in place (``p.grad.data =
        x``, ``p.grad.set_(x)``, ``p.grad.t_()``: the same object, other memory
        or another layout of its span, which the daemons would misread) back
        at its span as laid out at registration, holding the values it holds now
        (``names``, id(param) -> wire name, given: step() sends them; a
        shape or dtype that cannot be the param's grad is a ValueError
        naming the param) or any values (None: zero_grad zeroes them)."""
        if all(map(_IS_SET_TO, self._shared_grads, self._grad_homes)):
            return  # none moved (one pass in C)
        for (p, grad), home in zip(self.grads, self._grad_homes):
            if grad.is_set_to(home):
                continue
            # Its values only while it is the param's grad: one the param
            # no longer holds (replaced since) just goes back to its span.
            values = grad.clone() if names is not None and p.grad is grad else None
            if values is not None and (values.shape != home.shape
                                       or values.dtype != home.dtype):
                raise ValueError(
                    f"param {names[id(p)]}: its grad was moved in place to a tensor of "
                    f"shape {tuple(values.shape)} and dtype {values.dtype}, not the param's "
                    f"{tuple(home.shape)} and {home.dtype}")
            grad.data = home  # (not set_: the user may have changed its dtype)
            if values is not None:
                grad.copy_(values)

    def rebound_intact(self) -> bool:
        """Every rebound param is still its shared view: the same address,
        shape and dtype, contiguous as the view is (``follow_rebound_params``'
        test, for all at once). The params' whole layout as the last step
        that passed found it (``LayoutCache``: one call into torch's C++ where
        it can) answers first; the passes below only when it changed."""
        ps = self._rebound

        def intact():
            return (all(map(operator.eq, map(_DATA_PTR, ps), self._ptrs))
                    and all(map(operator.eq, map(_SHAPE, ps), self._shapes))
                    and all(map(operator.is_, map(_DTYPE, ps), self._dtypes))
                    and all(map(_CONTIGUOUS, ps)))
        return self._params_layout.holds(ps, intact)

    def reset(self) -> list[Buffer]:
        """Forgets every param (a new placement follows) and returns the
        old buffers, for the caller to release once their values moved."""
        old = list(self.buffers)
        self.buffers.clear()
        for _, bound in self.fsdp_bound:
            bound.unhook()
        self.regions, self.grads, self.views, self.dtensors = Regions(), [], [], []
        self.fsdp_bound, self._fsdp_params, self._to_bind_fsdp = [], None, []
        self._unallocated, self._to_rebind, self._to_copy = {}, [], []
        self.permuted, self._to_permute = [], []
        self._index_rebound()
        return old

    def _slot(self, role: str, numel: int, like: torch.Tensor) -> Slot:
        key = (role, like.dtype, like.device)
        if key not in self._unallocated:
            self._unallocated[key] = Buffer(self.job_id, f"unallocated-{len(self._unallocated)}",
                                            like.dtype, like.device)
        return Slot(self._unallocated[key], numel)

    def _slot_pair(self, numel: int, like: torch.Tensor) -> tuple[Slot, Slot]:
        return self._slot("param", numel, like), self._slot("grad", numel, like)

    def rebind(self, p: torch.nn.Parameter, numel: int) -> tuple[Slot, Slot]:
        """p's spans of `numel` elements (the model's tensor is the
        contiguous prefix) in the param and grad buffers; ``allocate`` moves
        p there. ``.grad`` stays as the user had it, as with torch.optim (None
        for a fresh model: a param the first backward does not reach is
        skipped, not stepped on a zero grad); step() copies a grad that is not
        in the shared buffer there and re-points ``.grad`` to it, and
        ``zero_grad(set_to_none=False)`` binds it at once (zero-copy)."""
        pslot, gslot = self._slot_pair(numel, p)
        self._to_rebind.append((p, pslot, gslot))
        return pslot, gslot

    def bind_dtensor(self, p):
        """A DTensor param's spans (a 0-row shard gets a 0-row view) and its
        local shard. An FSDP2 param FSDP2 keeps in the usual form gets a span
        of its padded shard, which ``allocate`` makes FSDP2's storage
        (fsdp2_storage: the daemons update it in place). Any other DTensor
        keeps its own storage: ``allocate`` copies the local values in and
        step() copies in and out."""
        local = p.to_local()
        if self._fsdp_params is None:
            self._fsdp_params = _fsdp2.fsdp_params()
        fsdp_param = self._fsdp_params.get(id(p))
        if fsdp_param is not None:
            padded = math.prod(fsdp_param.padded_sharded_param_size)
            pslot = self._slot("param", padded, local)
            gslot = self._slot("grad", local.numel(), local)
            self._to_bind_fsdp.append((p, fsdp_param, local, pslot, gslot))
            return pslot, gslot, local
        pslot, gslot = self._slot_pair(local.numel(), local)
        self._to_copy.append((p, local, pslot, gslot))
        return pslot, gslot, local

    def bind_permuted(self, p, perm: list):
        """A split QKV param's staging spans: its local rows reordered by
        ``perm`` (matrix after matrix). The param is never rebound: step()
        copies the rows in and out, as for a DTensor."""
        local = _local(p)
        pslot, gslot = self._slot_pair(local.numel(), local)
        index = torch.tensor(perm, dtype=torch.long, device=local.device)
        self._to_permute.append((p, local, pslot, gslot, index))
        return pslot, gslot

    def allocate(self, per_rank) -> None:
        """Makes every buffer placement asked for, moves the params into
        them (one batched copy) and points the refs of ``per_rank`` (each
        daemon's wire groups) at the buffers' regions."""
        for b in self._unallocated.values():
            b.allocate(self.regions)
            self.buffers.append(b)
        renamed = {b.key: b for b in self._unallocated.values() if b.key != b.region}
        with torch.no_grad():
            dst, src = [], []
            for p, pslot, gslot in self._to_rebind:
                view = pslot.view(p.shape)
                dst.append(view)
                src.append(p.data)
                self.grads.append((p, gslot.view(p.shape)))
            for p, local, pslot, gslot in self._to_copy:
                pview = pslot.view(local.shape)
                dst.append(pview)
                src.append(local)
                self.dtensors.append((p, pview, gslot.view(local.shape)))
            for p, local, pslot, gslot, index in self._to_permute:
                pview = pslot.view(local.shape)
                torch.index_select(local, 0, index, out=pview)
                self.permuted.append((p, pview, gslot.view(local.shape), index))
            if dst:
                torch._foreach_copy_(dst, src)
            for p, fsdp_param, local, pslot, gslot in self._to_bind_fsdp:
                bound = _fsdp2.BoundShard(
                    fsdp_param, pslot.view(tuple(fsdp_param.padded_sharded_param_size)),
                    gslot.view(local.shape))
                bound.bind()
                self.fsdp_bound.append((p, bound))
            for (p, _, _), view in zip(self._to_rebind, dst):
                p.data = view
                self.views.append((p, view, view.data_ptr()))
        self._index_rebound()
        if renamed:
            _point_refs_at_regions(per_rank, renamed)
        self._unallocated, self._to_rebind, self._to_copy = {}, [], []
        self._to_permute, self._fsdp_params, self._to_bind_fsdp = [], None, []

    def zero_grad(self, set_to_none: bool) -> None:
        """Muon.zero_grad's work (its docstring has the rules)."""
        with torch.no_grad():
            if set_to_none:
                for p in self._rebound:
                    p.grad = None
            elif self.grads_in_place():  # the zero-copy loop: all bound already
                _zero(self._shared_grads)
            else:
                self.rehome_grads(None)
                zeroed = []
                try:
                    for p, grad in self.grads:
                        if p.grad is None and not p.requires_grad:
                            continue
                        if p.grad is not grad:
                            p.grad = grad  # torch refuses a rebound param's: raised
                        zeroed.append(grad)
                finally:  # those bound before a refusal are zeroed, as they were bound
                    _zero(zeroed)
            for p, bound in self.fsdp_bound:
                # Zeroed in place: FSDP2's reduce-scatter accumulates into the
                # shared grad span (no copy at step()).
                if set_to_none:
                    p.grad = None
                elif p.requires_grad or p.grad is not None:
                    bound.grad_view.zero_()
                    if not bound.grad_in_span(p.grad):
                        p.grad = bound.grad_over()
            for p in [d[0] for d in self.dtensors] + [q[0] for q in self.permuted]:
                # Their grads stay the trainer's (FSDP2's, DTensor's, its own).
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
                elif p.requires_grad and not is_dtensor(p):  # as a rebound param's
                    p.grad = torch.zeros_like(p)

    def skipped_and_copy_grads(self, names: dict, ranks_of: dict, daemons: int,
                               grads_in_place: bool = False) -> list[list[str]]:
        """Per daemon, the names of the params this step skips (grad None or
        requires_grad False, as torch.optim skips grad None); every other
        grad not already in its shared buffer is copied there in one batched
        copy, and ``.grad`` re-pointed to the shared buffer. ``names``:
        id(param) -> wire name; ``ranks_of``: wire name -> daemons holding it;
        ``grads_in_place``: the caller found ``grads_in_place()`` true since the
        last change to any grad (not asked again)."""
        dst, src = [], []
        # The usual step: every rebound param's grad is where the daemons read
        # it (the frozen ones have none), and nothing to do for any of them
        # (grads_in_place).
        in_place = grads_in_place or self.grads_in_place()
        skipped = (self.frozen_skips(names, ranks_of, daemons) if in_place
                   else [[] for _ in range(daemons)])
        rebound = () if in_place else self.grads
        if rebound:
            with torch.no_grad():
                self.rehome_grads(names)
        for p, grad in rebound:
            current = p.grad
            if current is None or not p.requires_grad:
                name = names[id(p)]
                for rank in ranks_of[name]:
                    skipped[rank].append(name)
                continue
            if current is grad:  # the usual case: backward accumulated in place
                continue
            # Another tensor at the shared grad's address is that grad only
            # if laid out as it is (contiguous): a transposed view of it
            # holds the values transposed, and is copied.
            if current.data_ptr() != grad.data_ptr() or not current.is_contiguous():
                dst.append(grad)
                src.append(current)
            p.grad = grad
        for p, pview, gview in self.dtensors:
            # Every DTensor's values go in (a skipped one is copied back
            # unchanged), the grads of those stepped.
            dst.append(pview)
            src.append(p.to_local())
            if p.grad is None or not p.requires_grad:
                skipped[0].append(names[id(p)])
                continue
            dst.append(gview)
            src.append(_local_grad(p))
        for p, bound in self.fsdp_bound:  # the param is in the buffer already
            if p.grad is None or not p.requires_grad:
                skipped[0].append(names[id(p)])
                continue
            if not bound.grad_in_span(p.grad):
                dst.append(bound.grad_view)
                src.append(_local_grad(p))
        if dst:
            torch._foreach_copy_(dst, self._detached_from_buffers(src))
        for p, pview, gview, index in self.permuted:
            torch.index_select(_local(p), 0, index, out=pview)
            if p.grad is None or not p.requires_grad:
                for rank in ranks_of[names[id(p)]]:
                    skipped[rank].append(names[id(p)])
                continue
            grad = _local_grad(p) if is_dtensor(p) else p.grad
            torch.index_select(grad.to(gview.dtype), 0, index, out=gview)
        return skipped

    def check_permuted(self, names: dict) -> None:
        """Before any copy of a step: every split QKV param's values and grad
        still have the staging copy's shape, dtype and device (the copies
        would otherwise resize the staging view into other params' memory),
        else ValueError naming the param and what changed."""
        refused = []
        for p, pview, _, _ in self.permuted:
            for what, t in (("its values", _local(p)), ("its grad", _grad_of(p))):
                if t is None:
                    continue
                changed = [f"{k} {a} -> {b}" for k, a, b in (
                    ("shape", tuple(pview.shape), tuple(t.shape)),
                    ("dtype", pview.dtype, t.dtype), ("device", pview.device, t.device))
                    if a != b and not (what == "its grad" and k == "dtype")]
                if changed:
                    refused.append(f"param {names[id(p)]} ({what}): {', '.join(changed)}")
        if refused:
            raise ValueError(
                "muond.torch.Muon: a split QKV param must keep the shape, dtype and device it "
                "was registered with (step() copies its rows into registered memory); "
                + "; ".join(refused) + ". Build a new optimizer for the changed model (carry "
                "the state with state_dict / load_state_dict)")

    def any_cuda(self) -> bool:
        return (any(grad.is_cuda for _, grad in self.grads)
                or any(gview.is_cuda for _, _, gview in self.dtensors)
                or any(bound.grad_view.is_cuda for _, bound in self.fsdp_bound)
                or any(q[2].is_cuda for q in self.permuted))

    def copy_dtensors_out(self) -> None:
        """The updated DTensor and split QKV params back into their own
        local tensors."""
        if self.dtensors:
            torch._foreach_copy_([p.to_local() for p, _, _ in self.dtensors],
                                 [pview for _, pview, _ in self.dtensors])
        for p, pview, _, index in self.permuted:
            _local(p).index_copy_(0, index, pview)

    def follow_rebound_params(self, names: dict) -> None:
        """A param whose tensor was replaced after construction (``p.data =``,
        ``model.to()`` / ``.half()`` that moved it) is followed when the new
        tensor has the same shape, dtype and device: its values are copied into
        the shared buffer the daemons update and ``p.data`` is bound to it
        again. Otherwise step() refuses before any RPC, naming the param and
        what changed (the daemons can only update the memory registered)."""
        refused = []
        # The usual step: none rebound (rebound_intact: the test below for
        # every param at once, in C), so no loop over them at all.
        views = () if self.rebound_intact() else self.views
        for p, view, ptr in views:
            # The param itself, not p.data (no alias tensor), against the
            # cached address. The same address and shape laid out otherwise
            # (not contiguous: a transposed view of its own span) holds the
            # values in another order: followed, as a param rebound elsewhere.
            if (p.data_ptr() == ptr and p.shape == view.shape and p.dtype is view.dtype
                    and p.is_contiguous()):
                continue
            data = p.data
            changed = [f"{what} {a} -> {b}" for what, a, b in (
                ("shape", tuple(view.shape), tuple(data.shape)),
                ("dtype", view.dtype, data.dtype), ("device", view.device, data.device))
                if a != b]
            if changed:
                refused.append(f"param {names[id(p)]}: {', '.join(changed)}")
        replaced = [names[id(p)] for p, bound in self.fsdp_bound if bound.replaced()]
        if replaced:
            raise ValueError(
                "muond.torch.Muon: FSDP2 holds another Parameter object for "
                + ", ".join(f"param {n}" for n in replaced)
                + ": the module's Parameters were replaced (load_state_dict(..., assign=True) "
                "without torch.__future__.set_swap_module_params_on_conversion(True) does "
                "that), so this optimizer's params are no longer the model's and their grads "
                "never come. Load with swap_tensors on (the Parameter objects stay), or build "
                "a new optimizer over the model's params (carry the state with state_dict / "
                "load_state_dict)")
        for p, bound in self.fsdp_bound:
            # FSDP2 re-points a param itself (load_state_dict(assign=True), a move).
            if not bound.intact():
                changed = bound.bind_again()
                if changed:
                    refused.append(f"param {names[id(p)]}: {changed}")
        if refused:
            raise ValueError(
                "muond.torch.Muon follows a param rebound after construction only to a tensor "
                "of the same shape, dtype and device (its registered memory cannot change); "
                + "; ".join(refused) + ". Build a new optimizer for the changed model (carry "
                "the state with state_dict / load_state_dict)")
        with torch.no_grad():
            moved = [(p, view) for p, view, ptr in views
                     if p.data_ptr() != ptr or not p.is_contiguous()]
            for (p, view), src in zip(moved, self._detached_from_buffers(
                    [p.data for p, _ in moved])):
                view.copy_(src)
                p.data = view

    def _detached_from_buffers(self, tensors: list) -> list:
        """``tensors``, each one in this optimizer's buffers cloned: the
        copies of a step write those buffers, so a source there (a param or
        grad re-pointed at a view of its own span laid out otherwise, or at
        another param's span that this step also overwrites) is read before
        any of them."""
        ours = {b.flat.untyped_storage().data_ptr() for b in self.buffers
                if b.flat is not None}
        return [t.clone() if t.untyped_storage().data_ptr() in ours else t for t in tensors]

    def close(self) -> None:
        """The optimizer's end, once the daemons unregistered: each param and
        grad still in a CUDA buffer moves to memory of its own (the model
        works on), the shm names are unlinked (the model keeps its mapping)
        and every buffer is dropped: a CUDA buffer is freed once no tensor
        views it (one the caller still holds keeps it, never dangles)."""
        try:
            with torch.no_grad():
                for p, view, _ in self.views:
                    if view.is_cuda and p.data_ptr() == view.data_ptr():
                        p.data = view.clone()
                for p, grad in self.grads:
                    if grad.is_cuda and p.grad is grad:
                        p.grad = grad.clone()
                for p, bound in self.fsdp_bound:
                    if bound.padded.is_cuda:
                        bound.release()
                    gview = bound.grad_view
                    if gview.is_cuda and gview.numel() > 0 and bound.grad_in_span(p.grad):
                        p.grad = bound.grad_over(gview.clone())
        except Exception as e:  # e.g. out of memory: those params keep the buffer
            logging.getLogger("muond.torch").warning(
                "muond.torch.Muon: params left in the optimizer's CUDA buffers (%s); the "
                "buffers are freed once those params are", e)
        release(self.reset())


def _point_refs_at_regions(per_rank, renamed: dict) -> None:
    """Every ref naming a buffer by its key (``renamed``: key -> Buffer) now
    names the buffer's region, at the buffer's offset in it."""
    for groups in per_rank:
        for g in groups:
            for prm in g.params:
                for ref in (prm.param, prm.grad):
                    b = renamed.get(ref.region)
                    if b is not None:
                        ref.region = b.region
                        ref.byte_offset += b.base_offset


def _grad_of(p):
    """A param's grad as the tensor step() copies (a DTensor's local shard), or None."""
    if p.grad is None or not p.requires_grad:
        return None
    return _local_grad(p) if is_dtensor(p) else p.grad


def _local(p) -> torch.Tensor:
    """The tensor a param's values live in: a DTensor's local shard, else its data."""
    return p.to_local() if is_dtensor(p) else p.data


def _local_grad(p) -> torch.Tensor:
    """A DTensor param's grad as a local tensor shaped like its local shard
    (a grad with other placements, e.g. Partial, redistributed first)."""
    grad = p.grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


def _zero(tensors: list) -> None:
    """Zeroes ``tensors`` in one batched call (not one op per grad)."""
    if tensors:
        torch._foreach_zero_(tensors)


def release(buffers) -> None:
    """Releases ``buffers`` (Buffer.release)."""
    for b in buffers:
        b.release()
