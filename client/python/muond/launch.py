"""`muond launch [options] -- <command ...>`: muond's servers around any trainer.

Per-node mode (the default): one launcher per node starts one `muond-daemon`
per local rank (host mode, or one GPU each) and, on node rank 0, the
`muond-coordinator`; waits until every server it started answers the
standard grpc.health.v1 Check (any answer counts: a daemon is SERVING only
once its trainers registered); runs the command with the environment the
client reads (MUOND_JOB_ID, MUOND_TOKEN_FILE, MUOND_SOCKET_DIR,
MUOND_COORDINATOR, MUOND_NNODES, MUOND_NODE_RANK, MUOND_NPROC_PER_NODE,
MUOND_MASTER_ADDR); and stops everything it started when the command ends or
a server dies (naming it: rank, pid, exit status, last lines of its log):
every process of the command, those in sessions of their own included
(stop_command_processes).
Per-rank mode (--per-rank; automatic under torchrun or srun with one task
per GPU) starts only this process's daemon (and the coordinator on global
rank 0). Exit status: the command's, 1 when a server died first, 128+N on
signal N, 2 for refused options. deploy/README.md "muond launch" is the
reference; muond/_launch_env.py resolves options and environment.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid

from muond import _argtypes
from muond._launch_env import MAX_SOCKET_PATH, LaunchError, Plan, resolve

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "launch", help="start daemons + coordinator around a command",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="muond launch [options] -- <command ...>")
    add_options(p)
    return p


def _server_flag(text: str) -> str:
    if not text.startswith("--"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a server flag (--name=value)")
    return text


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (explicit options win over torchrun's and Slurm's "
                             "environment)")
    g.add_argument("--nproc-per-node", metavar="N", type=_argtypes.count, help="daemons on this node (default "
                   "$LOCAL_WORLD_SIZE, $SLURM_NTASKS_PER_NODE (not in an srun step of one task "
                   "per node), the visible GPUs with "
                   "--device cuda|auto, else 1)")
    g.add_argument("--nnodes", metavar="N", type=_argtypes.count, help="nodes of the job (default $SLURM_NNODES, "
                   "else 1)")
    g.add_argument("--node-rank", metavar="R", type=_argtypes.index, help="this node's rank (default "
                   "$SLURM_NODEID, $GROUP_RANK, $NODE_RANK, else 0); daemon rank = node rank "
                   "x nproc-per-node + local rank")
    g.add_argument("--master-addr", metavar="HOST", help="the coordinator's host, node rank 0 (default "
                   "$MASTER_ADDR, the first host of $SLURM_JOB_NODELIST, else 127.0.0.1)")
    g.add_argument("--coordinator-port", metavar="PORT", type=_argtypes.port, help="default 29400; a free loopback "
                   "port on a single node in per-node mode")
    g.add_argument("--node-addr", metavar="ADDR", help="this node's address for daemon-to-daemon traffic "
                   "(Gloo; default 127.0.0.1 on a single node, else the host name's address)")
    g.add_argument("--per-rank", action="store_true", help="start only this process's "
                   "daemon ($RANK/$SLURM_PROCID); automatic when $RANK and $WORLD_SIZE are "
                   "set, or $SLURM_PROCID with more tasks than nodes")
    g.add_argument("--per-node", action="store_true", help="per-node mode even where the "
                   "environment says per-rank (e.g. inside an sbatch script's batch step)")
    g = p.add_argument_group("servers")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu = host-mode daemons; cuda = local rank k on the k-th visible GPU "
                   "($CUDA_VISIBLE_DEVICES); auto = cuda when a GPU is visible")
    g.add_argument("--job-id", metavar="J", help="default $MUOND_JOB_ID, slurm-$SLURM_JOB_ID, "
                   "torchrun-$TORCHELASTIC_RUN_ID (per-rank), else generated (one launcher "
                   "only)")
    g.add_argument("--token-file", metavar="FILE", help="the job's token (default $MUOND_TOKEN_FILE; "
                   "required with several launchers; else generated 0600 in the socket dir)")
    g.add_argument("--tls-cert", metavar="PEM", help="PEM certificate: the coordinator serves TLS")
    g.add_argument("--tls-key", metavar="PEM", help="PEM private key for --tls-cert")
    g.add_argument("--tls-ca", metavar="PEM", help="PEM root: the daemons (and the health check) verify "
                   "the coordinator with it")
    g.add_argument("--bin-dir", metavar="DIR", help="where muond-daemon and muond-coordinator are "
                   "(flat or a bazel-bin tree; default $MUOND_BIN_DIR, else PATH, else the "
                   "repository's bazel-bin)")
    g.add_argument("--log-dir", metavar="DIR", help="server logs (default ./muond-logs/<job>)")
    g.add_argument("--log-format", choices=["text", "json"], help="the servers' "
                   "--log_format (default: theirs, text)")
    g.add_argument("--metrics-port", metavar="P", type=_argtypes.port, help="Prometheus endpoints: the "
                   "coordinator on P, local rank k's daemon on P+1+k (default off)")
    g.add_argument("--metrics-address", metavar="ADDR", help="the servers' "
                   "--metrics_address: where the endpoints listen (default theirs, 127.0.0.1; "
                   "0.0.0.0 or this node's address for a scraper on another host)")
    g.add_argument("--daemon-arg", action="append", default=[], type=_server_flag,
                   metavar="--FLAG=VALUE", help="pass to every daemon (repeatable)")
    g.add_argument("--coordinator-arg", action="append", default=[], type=_server_flag,
                   metavar="--FLAG=VALUE", help="pass to the coordinator (repeatable)")
    g.add_argument("--health-timeout", metavar="S", type=_argtypes.seconds, default=60.0,
                   help="seconds to wait for the servers to answer (default 60)")
    g.add_argument("--join-timeout", metavar="S", type=_argtypes.seconds_or_off, default=300.0,
                   help="on the coordinator's node: seconds after its own daemons answer "
                   "within which every rank of the job must have joined, else stop the "
                   "command and fail naming the missing ranks and nodes (default 300; 0 = off)")
    g.add_argument("--stop-grace", metavar="S", type=_argtypes.seconds, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 10); "
                   "torchrun gives its workers 30 s of its own: below that the launcher "
                   "SIGKILLs torchrun and its workers (found by $MUOND_SOCKET_DIR) itself")
    p.add_argument("user_command", nargs=argparse.REMAINDER, metavar="command",
                   help="after --: the command to run (e.g. torchrun ... train.py)")


# -- helpers ----------------------------------------------------------------------
def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def new_job_id() -> str:
    # pid + random tag: pids repeat across PID namespaces (containers).
    return f"muond{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _in_dir(directory: str, name: str, tree_path: str) -> str | None:
    for path in (os.path.join(directory, name), os.path.join(directory, tree_path)):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_servers(bin_dir: str | None, env) -> tuple[str, str, str]:
    """(muond-daemon, muond-coordinator, where from)."""
    daemon_rel, coord_rel = "server/daemon/muond-daemon", "server/coordinator/muond-coordinator"
    given = bin_dir or env.get("MUOND_BIN_DIR")
    if given:
        what = "--bin-dir" if bin_dir else "$MUOND_BIN_DIR"
        coord, daemon = _in_dir(given, "muond-coordinator", coord_rel), _in_dir(
            given, "muond-daemon", daemon_rel)
        if not coord or not daemon:
            missing = "muond-coordinator" if not coord else "muond-daemon"
            raise LaunchError(f"{what} {given}: no executable {missing} there (flat or "
                              f"{coord_rel if not coord else daemon_rel})")
        return daemon, coord, f"{what} {given}"
    coord, daemon = (shutil.which(name, path=env.get("PATH"))
                     for name in ("muond-coordinator", "muond-daemon"))
    if coord and daemon:
        return daemon, coord, "PATH"
    if coord or daemon:
        raise LaunchError(f"PATH: {coord or daemon} is there but no executable "
                          f"{'muond-daemon' if coord else 'muond-coordinator'}; pass --bin-dir")
    repo = checkout_root(os.getcwd())
    if repo:
        bazel_bin = os.path.join(repo, "bazel-bin")
        coord, daemon = (os.path.join(bazel_bin, rel) for rel in (coord_rel, daemon_rel))
        if os.access(coord, os.X_OK) and os.access(daemon, os.X_OK):
            return daemon, coord, bazel_bin
    where = f"--bin-dir {repo}/bazel-bin" if repo else "--bin-dir (a bundle's bin/ or a bazel-bin tree)"
    raise LaunchError(f"no muond-coordinator found: pass {where} or set $MUOND_BIN_DIR, put "
                      "muond-coordinator and muond-daemon on PATH, or build them (bazel build "
                      "//server/daemon:muond-daemon //server/coordinator:muond-coordinator)")


def checkout_root(start: str) -> str | None:
    """The nearest directory at or above `start` holding WORKSPACE: the
    checkout whose bazel-bin holds the servers (the package itself may be
    installed anywhere, a venv's site-packages included)."""
    here = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(here, "WORKSPACE")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def find_muonctl(coordinator_bin: str) -> str:
    """muonctl beside the coordinator (a bundle's bin/), in its bazel-bin
    tree, on PATH, else the bare name."""
    here = os.path.dirname(coordinator_bin)
    tree = os.path.dirname(os.path.dirname(here))
    for path in (os.path.join(here, "muonctl"), os.path.join(tree, "tools", "muonctl", "muonctl")):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("muonctl") or "muonctl"


def tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).rstrip("\n")
    except OSError:
        return "(no log)"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def write_token_file(directory: str) -> str:
    """A fresh token in directory/token, created 0600 (O_EXCL, O_NOFOLLOW)."""
    path = os.path.join(directory, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def _parent_death_signal():
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


def server_answers(address: str, ca_file: str | None = None, timeout: float = 1.0) -> bool:
    """True when a gRPC server answers grpc.health.v1 Check at `address`:
    SERVING, NOT_SERVING or any error status the server itself sent (servers
    built before the health service answer UNIMPLEMENTED); False while
    nothing listens there (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    import grpc
    from muond import health  # the raw call: needs grpcio only
    try:
        health.check(address, timeout=timeout, ca_file=ca_file)
        return True
    except grpc.RpcError as e:
        return e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.DEADLINE_EXCEEDED)


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class ServerDied(Exception):
    pass


class Server:
    def __init__(self, name: str, rank: int | None, proc: subprocess.Popen, log: str,
                 health_address: str, ca_file: str | None = None):
        self.name, self.rank, self.proc, self.log = name, rank, proc, log
        self.health_address, self.ca_file = health_address, ca_file

    def death(self) -> str | None:
        """What to say when it has exited, else None."""
        if self.proc.poll() is None:
            return None
        return (f"{self.name} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}; "
                f"last lines of {self.log}:\n{tail(self.log)}")


# -- the command's processes -----------------------------------------------------------
# torchrun starts each worker with start_new_session=True: a signal to the
# command's process group never reaches them, and once torchrun is SIGKILLed
# they are orphans (reparented to pid 1, or to the launcher: it is a child
# subreaper). Every process of the command is therefore found three ways: its
# process group, the tree below the pids the launcher holds, and the marker
# in its initial environment: MUOND_SOCKET_DIR=<this launch's socket dir>,
# unique per launch (mkdtemp) and inherited by everything the command starts
# (/proc/<pid>/environ, readable for the user's own processes).

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


def process_table() -> dict:
    """pid -> (ppid, pgid, state, start time in clock ticks) of every process
    in /proc (field numbers of proc(5) stat)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat_ = _proc_stat(int(name))
            if stat_:
                table[int(name)] = stat_
    return table


def _proc_stat(pid: int) -> tuple | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # the name may hold spaces and ")"
    return int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19])


def _dead(state: str) -> bool:
    return state in ("Z", "X")  # a zombie holds no memory: only its exit status


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
        if pid in exclude or _dead(state):
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
        seen = _proc_stat(pid)
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
            now = _proc_stat(pid)
            if now is None or now[3] != start or _dead(now[2]):
                del seen[pid]
        return dict(seen)

    if term_group:
        _signal_group(pgid, signal.SIGTERM)
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
        _signal_group(pgid, signal.SIGKILL)
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


def _signal_group(pgid: int, signum: int) -> bool:
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def remove_dead_shm(job_id: str) -> None:
    """The job's shm objects whose creator (the pid in the name, muond/shm.py)
    is gone: a node's trainers may still use theirs when another node's
    launcher ends first."""
    prefix = f"/dev/shm/muond-{job_id}-"
    for path in glob.glob(glob.escape(prefix) + "*"):
        pid = path[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(path)
            except OSError:
                pass


# -- the reaper ----------------------------------------------------------------------
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
                _reap(read, grace)
            except BaseException:  # never run the launcher's code in here
                code = 1
            os._exit(code)
        os.close(read)

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
        os.waitpid(self.pid, 0)


def _reap(read_fd: int, grace: float) -> None:
    for signum in (*_STOP_SIGNALS, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)  # a terminal's ^C goes to the launcher
    os.setsid()  # nor does its hang-up reach here
    launcher = os.getppid()
    groups = {"command": [], "server": []}
    sockdir, job, data = None, None, b""
    while True:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            break
        data += chunk
        *lines, data = data.split(b"\n")
        for line in lines:
            kind, _, value = line.decode().partition(" ")
            if kind == "done":
                return
            if kind == "dir":
                sockdir = value
            elif kind == "job":
                job = value
            elif kind in groups:
                groups[kind].append(int(value))
    # The launcher died without stopping what it started: the command (its
    # group and, by the marker, its processes in sessions of their own), then
    # the servers' groups.
    left = []
    for pgid in groups["command"]:
        left += stop_command_processes(
            lambda: command_processes(f"MUOND_SOCKET_DIR={sockdir}", pgid) if sockdir else {},
            pgid, grace)
    servers = groups["server"]
    for pgid in servers:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_signal_group(g, 0) for g in servers):
        time.sleep(0.05)
    for pgid in servers:
        _signal_group(pgid, signal.SIGKILL)
    if sockdir:
        shutil.rmtree(sockdir, ignore_errors=True)
    if job:
        remove_dead_shm(job)
    _log(f"the launcher (pid {launcher}) died: stopped its command and servers, removed "
         f"{sockdir or 'nothing'} and the job's shm objects"
         + (f"; could not stop: {'; '.join(left)}" if left else ""))


# -- the launch ---------------------------------------------------------------------
class Launch:
    def __init__(self, plan: Plan, args, daemon_bin: str, coordinator_bin: str,
                 reaper: Reaper | None = None):
        self.plan, self.args, self.reaper = plan, args, reaper
        self.daemon_bin, self.coordinator_bin = daemon_bin, coordinator_bin
        self.servers: list[Server] = []
        self.command: subprocess.Popen | None = None
        self.signalled: int | None = None
        self.sockdir: str | None = None
        self.log_dir = args.log_dir or os.path.join(os.getcwd(), "muond-logs", plan.job_id)
        self.token_file = plan.token_file
        self.coordinator = plan.coordinator_address()
        self.preexec = _parent_death_signal()
        self.deadline = float("inf")  # run() sets it
        self.join_deadline: float | None = None  # watching the job's membership until
        self.next_join_check = 0.0
        self._token: str | None = None

    # Signals only set a flag: every wait below polls it, so a signal never
    # cuts a Popen or the teardown in half.
    def on_signal(self, signum, _frame):
        if self.signalled is None:
            self.signalled = signum
            if self.command is not None:
                _signal_group(self.command.pid, signum)  # forwarded once

    def check(self) -> None:
        if self.signalled is not None:
            raise Interrupted(self.signalled)
        for server in self.servers:
            death = server.death()
            if death:
                raise ServerDied(death)

    def run(self) -> int:
        plan = self.plan
        self.deadline = time.monotonic() + self.args.health_timeout  # the whole start-up
        self.sockdir = tempfile.mkdtemp(prefix=f"muond-{plan.job_id}-", dir="/tmp")  # 0700
        self.tell("dir", self.sockdir)
        self.tell("job", plan.job_id)
        longest = self.socket_path(max(r for r, _ in plan.ranks))
        if len(longest) > MAX_SOCKET_PATH:
            raise LaunchError(f"--job-id {plan.job_id!r} is too long: the socket path "
                              f"{longest} exceeds {MAX_SOCKET_PATH} bytes")
        if self.token_file is None:
            self.token_file = write_token_file(self.sockdir)
        if plan.start_coordinator:
            self.start_coordinator()
        for (rank, local), gpu in zip(plan.ranks, plan.gpus):
            self.start_daemon(rank, local, gpu)
        self.wait_answering()
        where = "here" if plan.start_coordinator else f"on {plan.master_addr}"
        ranks = [r for r, _ in plan.ranks]
        print(f"muond launch: job {plan.job_id}: coordinator {self.coordinator} ({where}), "
              f"daemon rank{'s' if len(ranks) > 1 else ''} "
              f"{ranks[0]}{f'..{ranks[-1]}' if len(ranks) > 1 else ''} of {plan.world_size} "
              f"({plan.device}, "
              f"{plan.mode}) answering; logs in {self.log_dir}", flush=True)
        print(f"muond launch: while it runs: {find_muonctl(self.coordinator_bin)} status --coordinator {self.coordinator} "
              f"--job_id {plan.job_id} --token-file {self.token_file}", flush=True)
        return self.run_command()

    def tell(self, kind: str, value) -> None:
        if self.reaper:
            self.reaper.tell(kind, value)

    def socket_path(self, rank: int) -> str:
        return f"{self.sockdir}/muond-{self.plan.job_id}-{rank}.sock"

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise ServerDied(f"the servers did not start and answer within "
                             f"{self.args.health_timeout:g} s (--health-timeout bounds the "
                             f"whole start-up); {len(self.servers)} of "
                             f"{len(self.plan.ranks) + self.plan.start_coordinator} started")

    def start(self, name: str, rank: int | None, cmd: list, health_address: str,
              ca_file: str | None = None) -> None:
        self.check()
        self.check_deadline()
        log = os.path.join(self.log_dir, f"{name}.log")
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=self.preexec)
        self.tell("server", proc.pid)  # its own session: pgid == pid
        self.servers.append(Server(name if rank is None else f"daemon rank {rank}", rank, proc,
                                   log, health_address, ca_file))

    def common_flags(self, metrics_port: int | None) -> list:
        a = self.args
        flags = [f"--token_file={self.token_file}"]
        if a.log_format:
            flags.append(f"--log_format={a.log_format}")
        if metrics_port is not None:
            flags.append(f"--metrics_port={metrics_port}")
            if a.metrics_address:
                flags.append(f"--metrics_address={a.metrics_address}")
        return flags

    def coordinator_command(self, port_file: str | None) -> list:
        plan, a = self.plan, self.args
        cmd = [self.coordinator_bin, f"--listen={plan.coordinator_listen}",
               *self.common_flags(a.metrics_port)]
        if port_file:
            cmd.append(f"--port_file={port_file}")
        if a.tls_cert:
            cmd += [f"--tls_cert={a.tls_cert}", f"--tls_key={a.tls_key}"]
        return cmd + a.coordinator_arg

    def start_coordinator(self) -> None:
        plan, a = self.plan, self.args
        port_file = None
        if plan.coordinator_port == 0:
            port_file = os.path.join(self.sockdir, "coordinator.port")
        self.start("coordinator", None, self.coordinator_command(port_file), self.coordinator,
                   a.tls_ca if a.tls_cert else None)
        if port_file:
            while not (os.path.exists(port_file) and open(port_file).read().strip()):
                self.check()
                if time.monotonic() > self.deadline:
                    raise ServerDied(f"the coordinator did not report its port in "
                                     f"{a.health_timeout:g} s (--health-timeout); last lines "
                                     f"of {self.servers[0].log}:\n{tail(self.servers[0].log)}")
                time.sleep(0.05)
            with open(port_file) as f:
                self.coordinator = plan.coordinator_address(int(f.read().strip()))
            self.servers[0].health_address = self.coordinator

    def daemon_command(self, rank: int, local: int, gpu: int | None) -> list:
        """Daemon `rank` (local rank `local`; CUDA index `gpu` among the
        visible devices, None = host mode)."""
        plan, a = self.plan, self.args
        cmd = [self.daemon_bin, f"--job_id={plan.job_id}", f"--rank={rank}",
               f"--world_size={plan.world_size}", f"--coordinator={self.coordinator}",
               f"--listen=unix://{self.socket_path(rank)}",
               "--host" if gpu is None else f"--device={gpu}",
               f"--gloo_hostname={plan.node_addr}",
               *self.common_flags(None if a.metrics_port is None else a.metrics_port + 1 + local)]
        if a.tls_ca:
            cmd.append(f"--coordinator_tls_ca={a.tls_ca}")
        return cmd + a.daemon_arg

    def start_daemon(self, rank: int, local: int, gpu: int | None) -> None:
        self.start(f"muond-rank{rank}", rank, self.daemon_command(rank, local, gpu),
                   f"unix://{self.socket_path(rank)}")

    def wait_answering(self) -> None:
        deadline = self.deadline
        pending = list(self.servers)
        while pending:
            self.check()
            if server_answers(pending[0].health_address, pending[0].ca_file):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                s = pending[0]
                raise ServerDied(f"{s.name} (pid {s.proc.pid}) did not answer the health "
                                 f"check at {s.health_address} in "
                                 f"{self.args.health_timeout:g} s (--health-timeout); last "
                                 f"lines of {s.log}:\n{tail(s.log)}")
            time.sleep(0.1)

    def watches_joins(self) -> bool:
        """The coordinator's launcher watches the job's membership when other
        launchers start some of its daemons."""
        return (self.plan.start_coordinator and self.args.join_timeout > 0
                and len(self.plan.ranks) < self.plan.world_size)

    def joined_ranks(self) -> tuple[set, str]:
        """(ranks the coordinator lists for the job, error text or "")."""
        import grpc
        from muond.client import TOKEN_METADATA_KEY, read_token_file
        from muond.v1 import muond_pb2 as pb
        if self._token is None:
            try:
                self._token = read_token_file(self.token_file)
            except (OSError, ValueError) as e:
                return set(), str(e)
        ca = self.args.tls_ca if self.args.tls_cert else None
        if ca:
            with open(ca, "rb") as f:
                channel = grpc.secure_channel(self.coordinator,
                                              grpc.ssl_channel_credentials(f.read()))
        else:
            channel = grpc.insecure_channel(self.coordinator)
        with channel:
            call = channel.unary_unary("/muond.v1.Coordinator/ListDaemons",
                                       request_serializer=pb.ListDaemonsRequest.SerializeToString,
                                       response_deserializer=pb.ListDaemonsResponse.FromString)
            try:
                response = call(pb.ListDaemonsRequest(job_id=self.plan.job_id), timeout=5,
                                metadata=[(TOKEN_METADATA_KEY, self._token)])
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return set(), ""  # no daemon of the job joined yet
                return set(), f"ListDaemons: {e.code().name}: {e.details()}"
        return {d.rank for d in response.daemons}, ""

    def check_joins(self) -> None:
        """Called while the command runs: once every rank joined, stop
        watching; past --join-timeout, ServerDied naming who is missing."""
        if self.join_deadline is None or time.monotonic() < self.next_join_check:
            return
        self.next_join_check = time.monotonic() + 1.0
        joined, error = self.joined_ranks()
        missing = sorted(set(range(self.plan.world_size)) - joined)
        if not missing:
            self.join_deadline = None
            return
        if time.monotonic() > self.join_deadline:
            nproc = self.plan.nproc_per_node
            nodes = sorted({r // nproc for r in missing})
            shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
            raise ServerDied(
                f"job {self.plan.job_id}: {len(missing)} of {self.plan.world_size} daemons "
                f"did not join the coordinator within {self.args.join_timeout:g} s "
                f"(--join-timeout): rank{'s' if len(missing) > 1 else ''} {shown} on node "
                f"rank{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes[:16]))} "
                f"(rank // --nproc-per-node {nproc}); check those nodes' launchers and "
                f"logs (same --job-id, token, --master-addr){'; ' + error if error else ''}")

    def command_env(self) -> dict:
        plan = self.plan
        return dict(os.environ, MUOND_JOB_ID=plan.job_id, MUOND_TOKEN_FILE=self.token_file,
                    MUOND_SOCKET_DIR=self.sockdir, MUOND_COORDINATOR=self.coordinator,
                    MUOND_NNODES=str(plan.nnodes), MUOND_NODE_RANK=str(plan.node_rank),
                    MUOND_NPROC_PER_NODE=str(plan.nproc_per_node),
                    MUOND_MASTER_ADDR=plan.master_addr)

    def run_command(self) -> int:
        command = self.args.user_command
        try:
            # Its own session: a stop signals the command and all it started.
            self.command = subprocess.Popen(command, env=self.command_env(),
                                            start_new_session=True, preexec_fn=self.preexec)
        except OSError as e:
            raise LaunchError(f"command {command[0]!r}: {e.strerror}") from None
        self.tell("command", self.command.pid)
        if self.watches_joins():
            self.join_deadline = time.monotonic() + self.args.join_timeout
        while self.command.poll() is None:
            self.check()  # a server died: ServerDied, main() stops the command
            self.check_joins()
            self.reap_orphans()
            time.sleep(0.2)
        code = self.command.returncode
        code = 128 - code if code < 0 else code
        if code != 0:
            # Trainers whose daemon died fail too, maybe before the poll above
            # saw the daemon go: the dead server is the news.
            dead = next((d for d in map(Server.death, self.servers) if d), None)
            if dead:
                raise ServerDied(f"{dead}\n(the command then ended with exit status {code})")
        return code

    def marker(self) -> str:
        """What every process of the command has in its initial environment."""
        return f"MUOND_SOCKET_DIR={self.sockdir}"

    def held_pids(self) -> set:
        """The servers' pids and the reaper's: children, not the command's."""
        return {s.proc.pid for s in self.servers} | ({self.reaper.pid} if self.reaper else set())

    def reap_orphans(self) -> None:
        """Wait for the zombies that came back to this subreaper (orphans of
        the command); never for a Popen's own child (its status would be
        lost) nor the reaper."""
        me, held = os.getpid(), self.held_pids() | {self.command.pid if self.command else -1}
        for pid, (ppid, _, state, _) in process_table().items():
            if ppid == me and _dead(state) and pid not in held:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def command_processes(self) -> dict:
        """The command's live processes: its group, the tree below the
        command (while unreaped) and below orphans that came back here, and
        any process with the marker."""
        me, held = os.getpid(), self.held_pids()
        roots = {pid for pid, (ppid, _, state, _) in process_table().items()
                 if ppid == me and pid not in held and not _dead(state)}
        if self.command.returncode is None:
            roots.add(self.command.pid)
        return command_processes(self.marker(), self.command.pid, roots, held)

    def stop_command(self) -> list:
        """SIGTERM the command's process group (on_signal may have forwarded
        a stop signal there already) and its processes elsewhere (torchrun's
        workers), SIGKILL what is left after the grace period, reap. Returns
        what could not be stopped ("pid N (cmdline)")."""
        if self.command is None:
            return []
        return stop_command_processes(self.command_processes, self.command.pid,
                                      self.args.stop_grace, term_group=self.signalled is None,
                                      ended=lambda: self.command.poll() is not None,
                                      reap=self.reap_orphans)

    def stop_servers(self) -> None:
        """Daemons first, then the coordinator (no daemon sees it vanish and
        retries); SIGKILL after the grace period."""
        daemons = [s for s in self.servers if s.rank is not None]
        others = [s for s in self.servers if s.rank is None]
        for group in (daemons, others):
            for s in group:
                if s.proc.poll() is None:
                    _signal_group(s.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.args.stop_grace
            for s in group:
                try:
                    s.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(s.proc.pid, signal.SIGKILL)
                    s.proc.wait()

    def clean_up(self) -> None:
        """The socket dir (sockets, a generated token, the port file) and the
        job's shm objects whose creator is gone (remove_dead_shm)."""
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)
        remove_dead_shm(self.plan.job_id)

    def stop(self) -> list:
        """Everything stopped; returns the command's processes that could not
        be stopped ("pid N (cmdline)"), [] when none."""
        left = self.stop_command()
        self.stop_servers()
        self.clean_up()
        return left


def _alive(pid: int) -> bool:
    """A zombie counts as gone: its memory and shm mappings are released."""
    seen = _proc_stat(pid)
    return seen is not None and not _dead(seen[2])


def _log(message: str) -> None:
    print(f"muond launch: {message}", file=sys.stderr, flush=True)


USAGE = "muond launch [options] -- COMMAND ..."


def user_command(remainder: list) -> list:
    """The command after `--` (argparse's REMAINDER keeps the `--`); refused
    first, before anything is looked up: a launch without one would start
    servers for nothing."""
    if remainder[:1] != ["--"]:
        got = f"{remainder[0]!r} without --" if remainder else "no command"
        raise LaunchError(f"{got}: the command goes after -- ({USAGE})")
    if len(remainder) == 1:
        raise LaunchError(f"no command after -- ({USAGE}, e.g. muond launch -- torchrun ... "
                          "train.py)")
    return remainder[1:]


def check_paths(args, plan: Plan) -> None:
    """--log-dir creatable and writable, the token file a regular file:
    checked before anything starts."""
    log_dir = args.log_dir or os.path.join(os.getcwd(), "muond-logs", plan.job_id)
    what = "--log-dir" if args.log_dir else "the default log dir (--log-dir)"
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as e:
        raise LaunchError(f"{what} {log_dir}: not a writable directory ({e.strerror})") from None
    if plan.token_file is not None:
        where = plan.sources["token_file"]
        try:
            st = os.stat(plan.token_file)
        except OSError as e:
            raise LaunchError(f"{where} {plan.token_file}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise LaunchError(f"{where} {plan.token_file}: not a regular file (the job's "
                              "token: a file holding one line)")


def main(args) -> int:
    try:
        args.user_command = user_command(list(args.user_command))
        plan = resolve(args, os.environ, count_gpus=count_gpus, resolve_host=host_address,
                       new_job_id=new_job_id)
        daemon_bin, coordinator_bin, _ = find_servers(args.bin_dir, os.environ)
        check_paths(args, plan)
    except LaunchError as e:
        _log(f"error: {e}")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()  # a fork must not print the launcher's buffers twice
    reaper = Reaper(args.stop_grace)
    make_subreaper()  # after the fork: the reaper must not collect the launcher's orphans
    launch = Launch(plan, args, daemon_bin, coordinator_bin, reaper)
    for signum in _STOP_SIGNALS:
        signal.signal(signum, launch.on_signal)
    code = _run(launch)
    reaper.done()  # only once launch.stop() returned; else its EOF stops everything
    return code


def _run(launch: Launch) -> int:
    stopped = None  # what a stop signal then says: everything stopped, or not
    try:
        code, note = launch.run(), None
    except Interrupted as e:
        code, note = 128 + e.signum, f"stopped by signal {signal.Signals(e.signum).name}"
        stopped = f"{note}; stopped everything"
    except ServerDied as e:
        # Printed after the stop: what the stopped command prints must not
        # bury the name of what died.
        code, note = 1, f"FAILED: {e}"
    except LaunchError as e:
        code, note = 2, f"error: {e}"
    except BaseException:
        launch.stop()
        raise
    left = launch.stop()
    if left:
        # Not "stopped everything": a process of the command outlived SIGKILL
        # (e.g. stuck in the kernel), with its shm objects and device memory.
        stuck = (f"could not stop {len(left)} process{'es' if len(left) > 1 else ''} of the "
                 f"command (SIGKILL sent {KILL_WAIT:g} s ago): {'; '.join(left)}")
        _log(f"{note}; {stuck}" if note else f"FAILED: {stuck}")
        return code or 1
    if note:
        _log(stopped or note)
    return code
