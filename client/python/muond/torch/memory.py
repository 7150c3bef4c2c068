"""Memory the daemons can map: every param (and its grad) moved once into
POSIX shared memory (CPU, muond.shm) or a fresh CUDA allocation shared by IPC
handle, each distinct memory declared once to a daemon as a region, every
tensor referring to its region by name + byte offset (docs/ARCHITECTURE.md
"Memory registration"). ``SharedParams`` owns one optimizer's buffers and
the per-step copies between the model's tensors and them."""
from __future__ import annotations

import torch

from muond.shm import ShmBuffer
from muond.torch import wire as _wire
from muond.v1 import muond_pb2 as pb


class Regions:
    """The memory regions of one optimizer's buffers, one per distinct memory:
    an shm object, or a CUDA allocation. Small CUDA params share one
    caching-allocator block, hence one IPC handle and one region; torch tells
    each buffer only its own storage's offset and size in the block, so the
    region's byte_size is the largest end any of its buffers reaches (a safe
    lower bound of the allocation's size)."""

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
    """Memory one param (or its grad) lives in: a flat tensor plus the region
    a daemon reaches it through and the tensor's byte offset in it."""

    def __init__(self, job_id: str, numel: int, like: torch.Tensor, regions: Regions):
        self.shm = None
        if like.is_cuda:
            self.flat = torch.zeros(numel, dtype=like.dtype, device=like.device)
            storage = self.flat.untyped_storage()
            # (device, handle, storage_bytes, storage_offset_bytes, ...): the handle is
            # the IPC handle of the allocation *base*; our storage starts at the offset.
            info = storage._share_cuda_()
            self.base_offset = int(info[3])
            self.region = regions.cuda(int(info[0]), raw_cuda_ipc_handle(bytes(info[1])),
                                       self.base_offset + int(info[2]))
        elif like.device.type == "cpu":
            self.shm = ShmBuffer(job_id, numel, like.dtype)
            self.flat = self.shm.flat
            self.base_offset = 0
            self.region = regions.shm(self.shm)
        else:
            raise ValueError(f"muond handles cpu and cuda tensors, got {like.device}")

    def ref(self, offset: int, shape, strides) -> pb.TensorRef:
        itemsize = self.flat.element_size()
        return pb.TensorRef(region=self.region, byte_offset=self.base_offset + offset * itemsize,
                            dtype=_wire.DTYPES[self.flat.dtype], shape=list(shape),
                            strides=list(strides))

    def release(self) -> None:
        if self.shm is not None:
            self.shm.unlink()


CUDA_IPC_HANDLE_SIZE = 64


def raw_cuda_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t the wire wants, from torch's shareable
    handle. torch >= 2.2 (c10 CUDACachingAllocator::shareIpcHandle) writes
    [version byte][type byte][payload]: type 'c' = cudaMalloc block, payload the
    cudaIpcMemHandle_t of the allocation base; 'e' = expandable segment (a
    different payload that cudaIpcOpenMemHandle cannot open). Older torch
    returned the raw 64 bytes."""
    if len(handle) == CUDA_IPC_HANDLE_SIZE:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_SIZE + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError("CUDA tensors from expandable segments cannot be shared by "
                         "cudaIpcMemHandle; run the trainer with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise ValueError(f"unrecognised torch CUDA IPC handle ({len(handle)} bytes)")


class SharedParams:
    """One optimizer's params in daemon-visible memory: the buffers (the
    same list object for its whole life: the optimizer's finalizer releases
    it), their regions, each rebound param's (param, shared view, address),
    each param's (param, shared grad) and each DTensor param's (param,
    shared param view, shared grad view)."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.buffers: list[Buffer] = []
        self.regions = Regions()
        self.grads: list = []
        self.views: list = []
        self.dtensors: list = []

    def reset(self) -> list[Buffer]:
        """Forgets every param (a new placement follows) and returns the
        old buffers, for the caller to release once their values moved."""
        old = list(self.buffers)
        self.buffers.clear()
        self.regions, self.grads, self.views, self.dtensors = Regions(), [], [], []
        return old

    def _buffer_pair(self, numel: int, like: torch.Tensor):
        pbuf = Buffer(self.job_id, numel, like, self.regions)
        gbuf = Buffer(self.job_id, numel, like, self.regions)
        self.buffers += [pbuf, gbuf]
        return pbuf, gbuf

    def rebind(self, p: torch.nn.Parameter, numel: int):
        """Moves p into a daemon-visible buffer of `numel` elements (the
        model's tensor is the contiguous prefix) and makes its shared grad
        buffer. ``.grad`` stays as the user had it, as with torch.optim (None
        for a fresh model: a param the first backward does not reach is
        skipped, not stepped on a zero grad); step() copies a grad that is not
        in the shared buffer there and re-points ``.grad`` to it, and
        ``zero_grad(set_to_none=False)`` binds it at once (zero-copy)."""
        pbuf, gbuf = self._buffer_pair(numel, p)
        with torch.no_grad():
            view = pbuf.flat[:p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            self.views.append((p, view, view.data_ptr()))
            grad = gbuf.flat[:p.numel()].view(p.shape)
        self.grads.append((p, grad))
        return pbuf, gbuf

    def bind_dtensor(self, p):
        """A DTensor param's shared buffers (at least one element: a 0-row
        shard gets a 0-row view), its local values copied in. The param is
        never rebound (FSDP2 owns its storage): step() copies in and out."""
        local = p.to_local()
        n = local.numel()
        pbuf, gbuf = self._buffer_pair(max(n, 1), local)
        with torch.no_grad():
            pview = pbuf.flat[:n].view(local.shape)
            pview.copy_(local)
            gview = gbuf.flat[:n].view(local.shape)
        self.dtensors.append((p, pview, gview))
        return pbuf, gbuf, local

    def zero_grad(self, set_to_none: bool) -> None:
        """Muon.zero_grad's work (its docstring has the rules)."""
        with torch.no_grad():
            for p, grad in self.grads:
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad is None and not p.requires_grad:
                    continue
                if p.grad is not grad:
                    p.grad = grad
                grad.zero_()
            for p, _, _ in self.dtensors:  # their grads stay FSDP2's / DTensor's
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def skipped_and_copy_grads(self, names: dict, ranks_of: dict,
                               daemons: int) -> list[list[str]]:
        """Per daemon, the names of the params this step skips (grad None or
        requires_grad False, as torch.optim skips grad None); every other
        grad not already in its shared buffer is copied there in one batched
        copy, and ``.grad`` re-pointed to the shared buffer. ``names``:
        id(param) -> wire name; ``ranks_of``: wire name -> daemons holding it."""
        skipped: list[list[str]] = [[] for _ in range(daemons)]
        dst, src = [], []
        for p, grad in self.grads:
            current = p.grad
            if current is None or not p.requires_grad:
                name = names[id(p)]
                for rank in ranks_of[name]:
                    skipped[rank].append(name)
                continue
            if current is grad:  # the usual case: backward accumulated in place
                continue
            if current.data_ptr() != grad.data_ptr():
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
        if dst:
            torch._foreach_copy_(dst, src)
        return skipped

    def any_cuda(self) -> bool:
        return (any(grad.is_cuda for _, grad in self.grads)
                or any(gview.is_cuda for _, _, gview in self.dtensors))

    def copy_dtensors_out(self) -> None:
        """The updated DTensor params back into their own local tensors."""
        if self.dtensors:
            torch._foreach_copy_([p.to_local() for p, _, _ in self.dtensors],
                                 [pview for _, pview, _ in self.dtensors])

    def follow_rebound_params(self, names: dict) -> None:
        """A param whose tensor was replaced after construction (``p.data =``,
        ``model.to()`` / ``.half()`` that moved it) is followed when the new
        tensor has the same shape, dtype and device: its values are copied into
        the shared buffer the daemons update and ``p.data`` is bound to it
        again. Otherwise step() refuses before any RPC, naming the param and
        what changed (the daemons can only update the memory registered)."""
        refused = []
        for p, view, ptr in self.views:
            # Cheap per step (~0.3 us a param): the param itself, not p.data
            # (no alias tensor), against the cached address. The same address
            # and shape with other strides would be a view of our own buffer.
            if p.data_ptr() == ptr and p.shape == view.shape and p.dtype is view.dtype:
                continue
            data = p.data
            changed = [f"{what} {a} -> {b}" for what, a, b in (
                ("shape", tuple(view.shape), tuple(data.shape)),
                ("dtype", view.dtype, data.dtype), ("device", view.device, data.device))
                if a != b]
            if changed:
                refused.append(f"param {names[id(p)]}: {', '.join(changed)}")
        if refused:
            raise ValueError(
                "muond.torch.Muon follows a param rebound after construction only to a tensor "
                "of the same shape, dtype and device (its registered memory cannot change); "
                + "; ".join(refused) + ". Build a new optimizer for the changed model (carry "
                "the state with state_dict / load_state_dict)")
        with torch.no_grad():
            for p, view, ptr in self.views:
                if p.data_ptr() != ptr:
                    view.copy_(p.data)
                    p.data = view


def _local_grad(p) -> torch.Tensor:
    """A DTensor param's grad as a local tensor shaped like its local shard
    (a grad with other placements, e.g. Partial, redistributed first)."""
    grad = p.grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


def release(buffers) -> None:
    """Unlinks the shm names of ``buffers`` (mappings stay valid)."""
    for b in buffers:
        b.release()
