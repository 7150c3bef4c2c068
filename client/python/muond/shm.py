"""POSIX shared-memory buffers viewed as torch tensors (host mode).

A buffer is a shm object ``/muond-<job>-<pid>-<tag>-<n>`` (the file
``/dev/shm/muond-<job>-<pid>-<tag>-<n>``; tag and n random, mode 0600, zero-filled by
ftruncate), mapped MAP_SHARED by ``torch.from_file(..., shared=True)``. Each
buffer is one memory region of a registration (``muond.torch`` packs many
tensors into one and declares it by its name and ``nbytes``); the daemon opens
the same object once with ``shm_open(name)`` + ``mmap``: writes on either side
are visible to the other. ``unlink()`` removes the name; existing mappings
stay valid, so a model keeps working after the optimizer is closed.
Importing this module does not import torch (the launcher reads names).

A job id may contain dashes, so a name is read from the right
(``parse_shm_name``): the last three fields never do. ``muond launch`` relies
on it to remove only its own job's objects (``run`` never takes those of
``run-20261203``).
"""
from __future__ import annotations

import os
import re
import secrets
import uuid

SHM_DIR = "/dev/shm"
_PROCESS_TAG = uuid.uuid4().hex[:8]  # _TAG_HEX digits


def shm_name(job_id: str) -> str:
    """A fresh, unique shm object name (leading slash, no other slash).

    The pid alone is not unique: processes in other PID namespaces
    (containers, sandboxes) that share /dev/shm have the same small pids, so
    a per-process random tag follows it. The last field is random too (63
    bits, not a counter): another local user who reads the names in
    /dev/shm cannot create a trainer's next one first, which would fail its
    buffer or turn its step channel off (both create with O_EXCL).
    """
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id) or "job"
    return f"/muond-{job}-{os.getpid()}-{_PROCESS_TAG}-{secrets.randbits(63)}"


_TAG_HEX = 8


def parse_shm_name(name: str) -> tuple[str, int] | None:
    """(job id, creator pid) of a name shm_name made (with or without the
    leading slash or /dev/shm/), else None."""
    base = name.rsplit("/", 1)[-1]
    if not base.startswith("muond-"):
        return None
    fields = base[len("muond-"):].rsplit("-", 3)
    if len(fields) != 4:
        return None
    job, pid, tag, nonce = fields
    tag_ok = len(tag) == _TAG_HEX and all(c in "0123456789abcdef" for c in tag)
    if not (job and pid.isascii() and pid.isdigit() and tag_ok
            and nonce.isascii() and nonce.isdigit()):
        return None
    return job, int(pid)


class ShmBuffer:
    """One shm object of ``numel`` elements of ``dtype`` (a flat tensor view)."""

    def __init__(self, job_id: str, numel: int, dtype=None, name: str | None = None):
        """``name``: one shm_name(job_id) gave (muond.torch names a buffer's
        region before it allocates it); a fresh one by default."""
        import torch  # here: the launcher reads names (parse_shm_name) without torch

        dtype = torch.float32 if dtype is None else dtype
        if numel <= 0:
            raise ValueError(f"shm buffer needs numel > 0, got {numel}")
        self.name = name or shm_name(job_id)
        self.path = SHM_DIR + self.name
        self.dtype = dtype
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)
        self.flat = torch.from_file(self.path, shared=True, size=numel, dtype=dtype)
        self._unlinked = False

    def unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
