"""The local cluster: a process whose environment names no daemon (no launcher, no
torchrun, no ``daemons=``) starts a private muond-coordinator and one
muond-daemon for itself, as ``ray.init()`` starts a local cluster.

One cluster per process, started by the first optimizer that needs it and
shared by later ones: each holds a ``Lease``, and the last one released (a
step of the optimizer's finalizer: close(), garbage collection, interpreter
exit) stops the servers and removes the cluster's directory. The directory
(0700) holds a fresh token (0600), both Unix sockets and the servers' logs;
it is made under $TMPDIR, else /tmp, else the current directory: the first
where a socket's path fits a Unix socket's limit (``socket_dir``). A cluster
that fails to start keeps its servers' logs there and its error says where.

The servers are the launcher's (muond.launch): found by its lookup, started,
waited for and stopped by its functions, and watched by its reaper, which
stops them and removes the directory when this process dies without doing
it (SIGKILL included, also while they start). The reaper runs as a fresh
interpreter: a process with gRPC and torch threads must not fork.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref

from muond.launch.config import MAX_SOCKET_PATH
from muond.launch.discovery import find_servers
from muond.launch.errors import LaunchError, ServerDied
from muond.launch.launcher import (raise_if_one_died, start_server_process, stop_servers,
                                   wait_answering, write_token_file)
from muond.launch.messages import LOCAL_CLUSTER_PREFIX
from muond.launch.reaper import Reaper
from muond.launch.servers import Server

# The job of a local cluster when the first optimizer names none.
DEFAULT_JOB_ID = "local"
# How long the servers get to stop on SIGTERM before SIGKILL (muond launch's
# --stop-grace default).
STOP_GRACE_S = 10.0
DIR_PREFIX = "muond-local-"
# The longest name in the directory that is a socket's.
_LONGEST_SOCKET = "coordinator.sock"
# tempfile.mkdtemp's random part of a name.
_MKDTEMP_RANDOM_CHARS = 8


def socket_dir(bases: list[str] | None = None) -> str:
    """A fresh 0700 directory for a cluster, in the first of `bases`
    (default: tempfile's $TMPDIR choice, /tmp, the current directory) where
    its sockets' paths fit MAX_SOCKET_PATH bytes (a long $TMPDIR, as some
    clusters' job schedulers set, would make the servers fail to listen);
    LaunchError naming every base, its length and the fix when none does."""
    if bases is None:
        bases = [tempfile.gettempdir(), "/tmp", os.getcwd()]
    tried = []
    name = DIR_PREFIX + "x" * _MKDTEMP_RANDOM_CHARS
    for base in dict.fromkeys(bases):
        longest = len(os.path.join(os.path.abspath(base), name, _LONGEST_SOCKET).encode())
        if longest > MAX_SOCKET_PATH:
            tried.append(f"{base} ({longest} bytes)")
            continue
        try:
            return tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base)
        except OSError as e:
            tried.append(f"{base} ({e.strerror})")
    raise LaunchError(
        f"no directory for the local cluster's Unix sockets keeps their paths within "
        f"{MAX_SOCKET_PATH} bytes, a Unix socket path's limit, or can be made: tried "
        f"{'; '.join(tried)} (a socket there is {os.path.join(name, _LONGEST_SOCKET)}). Set "
        "$TMPDIR to a short writable directory (export TMPDIR=/tmp)")


class LocalCluster:
    """A coordinator and one daemon (rank 0 of 1) of job `job_id` in a
    private directory: host mode (shm) for `device` None, else
    ``--device=N`` (CUDA IPC). Started (and answering) when constructed."""

    def __init__(self, device: int | None, job_id: str, timeout: float):
        self.device, self.job_id, self.pid = device, job_id, os.getpid()
        self.directory = socket_dir()  # 0700
        self.servers: list[Server] = []
        self.reaper = None
        try:
            self.reaper = Reaper.spawned(STOP_GRACE_S, "the trainer", LOCAL_CLUSTER_PREFIX)
            self.reaper.tell("dir", self.directory)
            self.reaper.tell("job", job_id)
            self._start(timeout)
        except (LaunchError, ServerDied) as e:
            # The error quotes the logs' last lines; the whole logs stay, as
            # the error names them.
            if self.stop(keep_logs=True):
                raise type(e)(f"{e}\n(the servers' logs are kept in {self.directory}; remove "
                              "it when done)") from e
            raise
        except BaseException:
            self.stop()
            raise

    @property
    def daemon_address(self) -> str:
        return f"unix://{self.directory}/daemon.sock"

    @property
    def token_file(self) -> str:
        return os.path.join(self.directory, "token")

    def describe_device(self) -> str:
        return "the host (shm)" if self.device is None else f"cuda:{self.device}"

    def _start(self, timeout: float) -> None:
        daemon_bin, coordinator_bin, _ = find_servers(None, os.environ,
                                                      has_bin_dir_flag=False)
        token = write_token_file(self.directory)
        coordinator = f"unix://{self.directory}/coordinator.sock"
        self._start_server("local muond-coordinator", None,
                           [coordinator_bin, f"--listen={coordinator}", f"--token_file={token}"],
                           coordinator)
        self._start_server("local muond-daemon", 0, [
            daemon_bin, f"--job_id={self.job_id}", "--rank=0", "--world_size=1",
            f"--coordinator={coordinator}", f"--listen={self.daemon_address}",
            "--host" if self.device is None else f"--device={self.device}",
            f"--token_file={token}"], self.daemon_address)
        wait_answering(self.servers, time.monotonic() + timeout,
                       lambda: raise_if_one_died(self.servers),
                       f"{timeout:g} s (wait_healthy_timeout)")

    def _start_server(self, name: str, rank: int | None, cmd: list, address: str) -> None:
        log = os.path.join(self.directory, f"{name.rpartition(' ')[2]}.log")
        proc = start_server_process(cmd, log)
        self.reaper.tell("server", proc.pid)  # its own session: pgid == pid
        self.servers.append(Server(name, rank, proc, log, address))

    def stop(self, keep_logs: bool = False) -> bool:
        """The servers stopped, the directory removed (with `keep_logs` all
        but the servers' logs, when there are any), the reaper told so; True
        when logs were kept. Nothing in a forked child: the servers are its
        parent's."""
        if os.getpid() != self.pid:
            return False
        stop_servers(self.servers, STOP_GRACE_S)
        logs = {os.path.basename(s.log) for s in self.servers if os.path.exists(s.log)}
        kept = keep_logs and bool(logs)
        if kept:
            for name in set(os.listdir(self.directory)) - logs:  # the token, the sockets
                os.unlink(os.path.join(self.directory, name))
        else:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.reaper is not None:
            self.reaper.done()
        return kept


class Lease:
    """One optimizer's use of this process's cluster. ``release()`` (also
    when the lease is collected unreleased) ends the use once; the last
    release stops the cluster."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.release = weakref.finalize(self, _release, cluster)


_lock = threading.Lock()
_cluster: LocalCluster | None = None
_users = 0


def current() -> LocalCluster | None:
    """This process's running local cluster, if any."""
    with _lock:
        return _cluster if _cluster is not None and _cluster.pid == os.getpid() else None


def acquire(device: int | None, job_id: str | None, timeout: float) -> Lease:
    """A lease on this process's cluster, started first when there is none.
    ValueError when the running one cannot serve this optimizer (another
    device or job id); RuntimeError naming the cause when the servers cannot
    be found or do not start."""
    global _cluster, _users
    with _lock:
        if _cluster is None or _cluster.pid != os.getpid():  # a fork's copy is not ours
            _cluster, _users = _start(device, job_id or DEFAULT_JOB_ID, timeout), 0
        else:
            _check_compatible(_cluster, device, job_id)
            raise_if_one_died(_cluster.servers)
        _users += 1
        return Lease(_cluster)


def death_note(address: str) -> str:
    """When ``address`` is this process's local daemon and its process has
    exited (waited for up to a second: a closed socket comes first): what
    happened and what to do; else ""."""
    cluster = current()
    if cluster is None:
        return ""
    for server in cluster.servers:
        if server.health_address != address:
            continue
        try:
            server.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return ""
        return (f"\n{server.death_message()}\nThe local cluster is not restarted and its "
                "optimizer state is gone: close() every optimizer of this process, build "
                "a new one (it starts a fresh local cluster) and load_state_dict a saved "
                "state")
    return ""


def _start(device: int | None, job_id: str, timeout: float) -> LocalCluster:
    try:
        return LocalCluster(device, job_id, timeout)
    except (LaunchError, ServerDied) as e:
        raise RuntimeError(
            f"muond.torch.Muon: nothing names a daemon for this process (no daemons=, no "
            f"muond launch or torchrun environment), so it starts a local coordinator and "
            f"daemon, which failed: {e}. Set MUOND_LOCAL=0 to turn the local cluster off") from e


def _check_compatible(cluster: LocalCluster, device: int | None, job_id: str | None) -> None:
    if job_id is not None and job_id != cluster.job_id:
        raise ValueError(f"job_id={job_id!r}: this process's local daemon runs job "
                         f"{cluster.job_id!r} (its first optimizer's); give that job_id or none")
    if device != cluster.device:
        wanted = "the host" if device is None else f"cuda:{device}"
        raise ValueError(f"muond.torch.Muon: this process's local daemon runs on "
                         f"{cluster.describe_device()} (its first optimizer's params), this "
                         f"optimizer's params are on {wanted}: keep every optimizer's params on "
                         "one device, or start daemons per device (muond launch)")


def _release(cluster: LocalCluster) -> None:
    global _cluster, _users
    with _lock:
        if cluster is not _cluster:
            return  # already stopped (its servers died and it was replaced)
        _users -= 1
        if _users > 0:
            return
        _cluster = None
    cluster.stop()
