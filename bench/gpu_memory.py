"""The whole GPU's memory in use, sampled: what a trainer's
torch.cuda.max_memory_allocated misses (muond's daemon process, torch's cache)."""
from __future__ import annotations

import threading


class GpuUsedPeak:
    """The most memory the whole GPU had in use (cudaMemGetInfo: every process on
    it, the trainer's CUDA allocations and cache and the daemon's state, staging
    and workspaces alike) above what it had in use when this began, sampled every
    millisecond on a thread of its own from construction to stop() (GiB)."""

    def __init__(self, device="cuda"):
        import torch
        self._device, self._torch = device, torch
        self._base = self._used()
        self._peak = self._base
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return total - free

    def _sample(self):
        while not self._done.wait(0.001):
            self._peak = max(self._peak, self._used())

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return (max(self._peak, self._used()) - self._base) / 2**30
