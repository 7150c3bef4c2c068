"""CUDA memory the optimizer owns and frees: one cudaMalloc per packed buffer,
shared with the daemons by its cudaIpcMemHandle (cuda-python's
``cuda.bindings.runtime``, the ``muond[cuda]`` extra).

Not torch's caching allocator: a block torch shares by IPC handle
(``_share_cuda_``) is reference counted across processes and kept in torch's
"limbo" until the consumer releases it, which a daemon (no torch) never does,
so every optimizer's buffers would stay allocated until the trainer exits.
Here the allocation is freed (cudaFree) as soon as no tensor views it; the
optimizer's end unregisters first (the daemon closes its IPC mapping), then
moves the model's params and grads out and drops its own views."""
from __future__ import annotations

import ctypes

import torch

# The bytes of a cudaIpcMemHandle_t (the wire's cuda_ipc_handle).
CUDA_IPC_HANDLE_SIZE = 64
_INSTALL_HINT = ("pip install 'muond[cuda]' (cuda-bindings, matching the CUDA major of "
                 "torch.version.cuda)")


def _runtime():
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        raise ImportError("muond.torch.Muon shares CUDA params with the daemons through "
                          f"cuda-python, which is not installed: {_INSTALL_HINT}") from e
    return runtime


def _check(runtime, err, what: str) -> None:
    if err != runtime.cudaError_t.cudaSuccess:
        _, name = runtime.cudaGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode()} "
                           f"({runtime.cudaGetErrorString(err)[1].decode()})")


class CudaAllocation:
    """``nbytes`` of device memory on cuda:``device`` (cudaMalloc: 256-byte
    aligned at least) and its 64-byte IPC handle. ``tensor`` views it as a
    torch tensor that keeps this object alive; cudaFree runs once the last
    such tensor (and this object) is gone."""

    def __init__(self, device: int, nbytes: int):
        self._rt = _runtime()
        self.device, self.nbytes, self.ptr = device, nbytes, None
        with torch.cuda.device(device):  # sets the context cudaMalloc uses
            err, ptr = self._rt.cudaMalloc(nbytes)
            _check(self._rt, err, f"cudaMalloc of {nbytes} bytes on cuda:{device}")
            self.ptr = int(ptr)
            err, handle = self._rt.cudaIpcGetMemHandle(self.ptr)
            _check(self._rt, err, f"cudaIpcGetMemHandle on cuda:{device}")
        self.handle = ctypes.string_at(handle.getPtr(), CUDA_IPC_HANDLE_SIZE)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 2}

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole allocation as a flat tensor of ``dtype``."""
        return torch.as_tensor(self, device=torch.device("cuda", self.device)).view(dtype)

    def __del__(self):
        if self.ptr is None:
            return
        ptr, self.ptr = self.ptr, None
        try:
            # cudaFree waits for the device's pending work, so no kernel still
            # reads the memory; it needs no current device of its own.
            self._rt.cudaFree(ptr)
        except Exception:  # interpreter teardown: the process frees it anyway
            pass
