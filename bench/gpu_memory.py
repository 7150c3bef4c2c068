"""The whole GPU's memory in use, sampled: what a trainer's
torch.cuda.max_memory_allocated misses (muond's daemon process, torch's cache)."""
from __future__ import annotations

import os
import subprocess
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
        self._by_pid: dict[int, int] = {}
        self._pids = threading.Thread(target=self._sample_processes, daemon=True)
        self._pids.start()

    def _used(self) -> int:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return total - free

    def _sample(self):
        while not self._done.wait(0.001):
            self._peak = max(self._peak, self._used())

    def _sample_processes(self):
        """Each process's GPU memory (nvidia-smi: CUDA context, allocator cache and
        all), every 500 ms: where the whole-GPU peak goes."""
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                 "--format=csv,noheader,nounits"]
        while not self._done.wait(0.5):
            try:
                rows = subprocess.run(query, capture_output=True, text=True,
                                      timeout=5).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                return
            for row in rows:
                pid, _, mib = row.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    self._by_pid[int(pid)] = max(self._by_pid.get(int(pid), 0),
                                                 int(mib) << 20)

    def process_peaks(self) -> dict:
        """GiB, the most each process held while this ran: "this process" (the
        trainer) and "other processes" (the sum of their peaks: muond's daemon
        and anything else on the GPU); empty where nvidia-smi is missing."""
        mine = self._by_pid.get(os.getpid(), 0)
        others = sum(b for pid, b in self._by_pid.items() if pid != os.getpid())
        if not self._by_pid:
            return {}
        return {"this process": mine / 2**30, "other processes": others / 2**30}

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        self._pids.join()
        return (max(self._peak, self._used()) - self._base) / 2**30
