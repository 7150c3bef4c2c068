"""The reaper: a process forked before anything starts that cleans up after
a launcher killed by SIGKILL (which runs no code of its own). A trainer's
local cluster (muond.local) runs the same reaper as a fresh interpreter
(``Reaper.spawned``: the pipe on its stdin): a
process with gRPC and torch threads must not fork."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from muond.launch.messages import LAUNCH_PREFIX, log
from muond.launch.processes import (command_processes, remove_dead_shm, signal_group,
                                    stop_command_processes)

# The signals that stop a launch; the reaper ignores them (they are the
# launcher's to act on).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Reaper:
    """A process forked at start that outlives a SIGKILLed launcher: the
    launcher tells it over a pipe what it started (process groups, the
    socket dir, the job) and "done" when it has stopped everything itself.
    EOF without "done" means the launcher died: the reaper stops every
    process of the command (stop_command_processes: its group and, by the
    socket dir marker, its workers in sessions of their own), then the
    servers' groups (SIGKILL after the stop grace), and removes the socket
    dir with its generated token and the job's dead shm objects (one rule
    with the launcher's: remove_dead_shm). The parent-death signal
    alone reaches only the direct children, and a command may ignore it."""

    def __init__(self, grace: float):
        read, self._write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the reaper
            os.close(self._write)
            code = 0
            try:
                _reaper_main(read, grace)
            except BaseException:  # never run the launcher's code in here
                code = 1
            os._exit(code)
        os.close(read)
        self._wait = lambda: os.waitpid(self.pid, 0)

    @classmethod
    def spawned(cls, grace: float, owner: str, prefix: str = LAUNCH_PREFIX) -> "Reaper":
        """The reaper as a new interpreter, not a fork; `owner` names the
        process it watches in its log line ("the trainer"), `prefix` whose
        line it is (a local cluster's, not `muond launch`'s)."""
        import muond  # the package root, for the child's sys.path
        root = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        read, write = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from muond.launch.reaper import "
                 "run_on_stdin; run_on_stdin(*sys.argv[1:])", repr(grace), owner, prefix],
                stdin=read, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path))
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self = cls.__new__(cls)
        self.pid, self._write, self._wait = proc.pid, write, proc.wait
        return self

    def tell(self, kind: str, value) -> None:
        try:
            os.write(self._write, f"{kind} {value}\n".encode())
        except OSError:
            pass  # the reaper is gone: nothing else to do

    def done(self) -> None:
        """Everything stopped: the reaper exits (and is waited for, so no
        process of the job outlives the launcher)."""
        self.tell("done", "")
        os.close(self._write)
        self._wait()


def _reaper_main(read_fd: int, grace: float, owner: str = "the launcher",
                 prefix: str = LAUNCH_PREFIX) -> None:
    for signum in (*STOP_SIGNALS, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)  # a terminal's ^C goes to the launcher
    os.setsid()  # nor does its hang-up reach here
    launcher = os.getppid()
    started = _read_until_done(read_fd)
    if started is not None:
        _stop_after_launcher_died(launcher, *started, grace, owner, prefix)


def _read_until_done(read_fd: int) -> tuple[dict, str | None, str | None] | None:
    """What the launcher said it started ({"command": [pgid], "server":
    [pgid]}, socket dir, job) once the pipe closes without "done"; None
    after "done" (the launcher stopped everything itself)."""
    groups = {"command": [], "server": []}
    sockdir, job, data = None, None, b""
    while True:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            return groups, sockdir, job
        data += chunk
        *lines, data = data.split(b"\n")
        for line in lines:
            kind, _, value = line.decode().partition(" ")
            if kind == "done":
                return None
            if kind == "dir":
                sockdir = value
            elif kind == "job":
                job = value
            elif kind in groups:
                groups[kind].append(int(value))


def _stop_after_launcher_died(launcher: int, groups: dict, sockdir: str | None,
                              job: str | None, grace: float, owner: str, prefix: str) -> None:
    """The launcher died without stopping what it started: the command (its
    group and, by the marker, its processes in sessions of their own), then
    the servers' groups; then the socket dir and the job's dead shm objects."""
    left = []
    for pgid in groups["command"]:
        left += stop_command_processes(
            lambda: command_processes(f"MUOND_SOCKET_DIR={sockdir}", pgid) if sockdir else {},
            pgid, grace)
    servers = groups["server"]
    for pgid in servers:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(signal_group(g, 0) for g in servers):
        time.sleep(0.05)
    for pgid in servers:
        signal_group(pgid, signal.SIGKILL)
    if sockdir:
        shutil.rmtree(sockdir, ignore_errors=True)
    if job:
        remove_dead_shm(job)
    stopped = "its command and servers" if groups["command"] else "its servers"
    log(f"{owner} (pid {launcher}) died: stopped {stopped}, removed "
        f"{sockdir or 'nothing'} and the job's shm objects"
        + (f"; could not stop: {'; '.join(left)}" if left else ""), prefix)


def run_on_stdin(grace: str, owner: str, prefix: str = LAUNCH_PREFIX) -> None:
    """The spawned reaper's main (Reaper.spawned): the pipe is stdin."""
    _reaper_main(0, float(grace), owner, prefix)
