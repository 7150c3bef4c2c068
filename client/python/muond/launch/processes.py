"""Process supervision below the launcher: find every process of the user's
command, signal it safely, stop it (SIGTERM, then SIGKILL after a grace
period), reap the orphans that come back to the launcher, and remove the
job's shared-memory objects whose creator is gone. Linux only (/proc, prctl).

torchrun starts each worker with start_new_session=True: a signal to the
command's process group never reaches them, and once torchrun is SIGKILLed
they are orphans (reparented to pid 1, or to the launcher: it is a child
subreaper). Every process of the command is therefore found three ways: its
process group, the tree below the pids the launcher holds, and the marker
in its initial environment: MUOND_SOCKET_DIR=<this launch's socket dir>,
unique per launch (mkdtemp) and inherited by everything the command starts
(/proc/<pid>/environ, readable for the user's own processes).
"""
from __future__ import annotations

import ctypes
import glob
import os
import signal
import time

from muond.shm import SHM_DIR, parse_shm_name

# After SIGKILL the kernel still has to tear a process down (a GPU context's
# device memory, mappings): how long the stop waits for that before it names
# what is left.
KILL_WAIT = 10.0
PR_SET_CHILD_SUBREAPER = 36


def make_subreaper() -> bool:
    """Orphaned descendants (torchrun's workers after torchrun died) come
    back to this process instead of pid 1: the launcher can find, stop and
    reap them."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_death_signal():
    """preexec_fn: the child gets SIGTERM when the launcher dies (even by
    SIGKILL), so no server outlives it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec():
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher already died
            os._exit(1)
    return preexec


def process_table() -> dict:
    """pid -> (ppid, pgid, state, start time in clock ticks) of every process
    in /proc (field numbers of proc(5) stat)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat_ = proc_stat(int(name))
            if stat_:
                table[int(name)] = stat_
    return table


def proc_stat(pid: int) -> tuple | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the name may hold spaces and ")"
    return int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19])


def is_dead(state: str) -> bool:
    return state in ("Z", "X")  # a zombie holds no memory: only its exit status


def is_alive(pid: int) -> bool:
    """A zombie counts as gone: its memory and shm mappings are released."""
    seen = proc_stat(pid)
    return seen is not None and not is_dead(seen[2])


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False  # gone, or another user's


def command_processes(marker: str, pgid: int | None, roots=(), exclude=()) -> dict:
    """pid -> start time of every live process of the command: in process
    group `pgid`, below one of `roots` (pids the caller holds: not reused
    while unreaped), or with `marker` (NAME=value) in its initial
    environment; never `exclude` (servers, the reaper) nor this process."""
    table = process_table()
    me, entry = os.getpid(), marker.encode()
    roots, exclude = set(roots), {me, *exclude}
    found = {}
    for pid, (ppid, group, state, start) in table.items():
        if pid in exclude or is_dead(state):
            continue
        up, seen = pid, 0
        while up in table and up not in roots and seen < 64:  # the tree, bounded
            up, seen = table[up][0], seen + 1
        if group == pgid or up in roots or _environ_has(pid, entry):
            found[pid] = start
    return found


def signal_process(pid: int, start: int, signum: int) -> bool:
    """Signal `pid` only while it is the process seen (same start time): a
    pid may be reused. A pidfd pins the process between check and signal."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    try:
        seen = proc_stat(pid)
        if seen is None or seen[3] != start:
            return False
        if fd is None:
            os.kill(pid, signum)
        else:
            signal.pidfd_send_signal(fd, signum)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def describe_process(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    return f"pid {pid} ({' '.join(a for a in argv if a)[:200] or '?'})"


def stop_command_processes(find, pgid: int, grace: float, term_group: bool = True,
                           ended=lambda: True, reap=lambda: None) -> list:
    """Stop the command: SIGTERM its process group (unless a forwarded stop
    signal already went there) and, once each, every process `find()`
    returns outside that group (a second SIGTERM could cut torchrun's own
    shutdown short); after `grace` s, SIGKILL all of them; wait up to
    KILL_WAIT s for the kernel to finish them (`reap` collects orphans that
    came back to the caller). Returns "pid N (cmdline)" of what still lives."""
    termed, seen = set(), {}

    def live():
        # Once seen, a process counts until it is gone or a zombie: an exiting
        # one has already lost its environ (the marker) but may still hold
        # its memory, shm mappings and device memory.
        seen.update(find())
        for pid, start in list(seen.items()):
            now = proc_stat(pid)
            if now is None or now[3] != start or is_dead(now[2]):
                del seen[pid]
        return dict(seen)

    if term_group:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        reap()
        left = live()
        for pid, start in left.items():
            if (pid, start) not in termed and _pgid(pid) != pgid:
                termed.add((pid, start))
                signal_process(pid, start, signal.SIGTERM)
        if (ended() and not left) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    deadline = time.monotonic() + KILL_WAIT
    while left or not ended():
        signal_group(pgid, signal.SIGKILL)
        for pid, start in left.items():
            signal_process(pid, start, signal.SIGKILL)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
        reap()
        left = live()
    return [describe_process(pid) for pid in left]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def remove_dead_shm(job_id: str) -> list[str]:
    """Removes the job's shm objects whose creator (the pid in the name,
    muond.shm.parse_shm_name) is gone: a node's trainers may still use theirs
    when another node's launcher ends first. Only names of exactly this job
    id: another job's id may start with it (``run`` and ``run-20261203``).
    Returns the paths it removed."""
    removed = []
    for path in glob.glob(glob.escape(f"{SHM_DIR}/muond-{job_id}-") + "*"):
        owner = parse_shm_name(path)
        if owner is not None and owner[0] == job_id and not is_alive(owner[1]):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return sorted(removed)
