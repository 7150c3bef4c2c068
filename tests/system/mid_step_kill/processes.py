"""The job's processes, found by their command lines, and what a run cut
short leaves behind (processes, socket dirs, shm objects)."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def processes_naming(text: str) -> list[int]:
    pids = (int(p.split("/")[2]) for p in glob.glob("/proc/[0-9]*"))
    return [pid for pid in pids if pid != os.getpid() and text in "\0".join(cmdline(pid))]


def stop_everything(launch: subprocess.Popen, job: str, tmp: str) -> None:
    """A run that did not end by itself (--timeout, a stop signal): SIGKILL
    the launcher and everything naming the job or the run's directory (the
    launcher's servers and torchrun with its trainers, each in its own
    session), until none is left (10 s at most), then the job's socket dirs
    and shm objects the launcher had no chance to remove. No grace: a run
    cut short is a FAIL anyway, and a caller's cap leaves CLEANUP_S."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = set(processes_naming(job) + processes_naming(tmp))
        if launch.poll() is None:
            pids.add(launch.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launch.poll()
        time.sleep(0.1)
    remove_leftovers(job)


def remove_leftovers(job: str) -> None:
    """This job's socket dirs and shm objects (its name is this run's own)."""
    for path in glob.glob(f"/tmp/muond-{job}-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(f"/dev/shm/muond-{job}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


