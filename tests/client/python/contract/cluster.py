"""A muond cluster of real binaries for Python tests: one muond-coordinator and
N host-mode `muond-daemon`s of one job, on Unix sockets (or one TCP listener),
all with a shared token file.

    with Cluster(num_daemons=2) as cluster:
        opt = Muon(..., daemons=cluster.daemons, job_id=cluster.job_id,
                   gtp_size=1, tp_size=2)

`Cluster.start()` waits until the coordinator wrote its port file and every
daemon answers Health; `stop()` SIGTERMs everything (SIGKILL after 10 s) and,
when asked (`print_logs=True`, e.g. after a failed test), prints each log's
tail to stderr. It then removes the job's shm objects whose creator is gone
and fails (AssertionError, naming them) when there were any: a trainer
process ended without unlinking its buffers (an optimizer never closed, or a
cleanup path of muond's that lost them), which would stay in /dev/shm for
good. The binaries come from Bazel's runfiles when run by `bazel test`, else
from the checkout's bazel-bin/ (run `bazel build
//server/daemon:muond-daemon //server/coordinator:muond-coordinator` first), or from
$MUOND_BIN_DIR (a directory holding server/daemon/muond-daemon etc.).

unittest helper: `ClusterTestCase` starts one cluster per test class
(`NUM_DAEMONS`, `TCP`) and prints the logs when a test of the class failed.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_binary(relpath: str) -> str:
    """`relpath` (e.g. server/daemon/muond-daemon) under the runfiles root, the
    checkout's bazel-bin or $MUOND_BIN_DIR, whichever exists first."""
    repo = os.path.abspath(os.path.join(_HERE, "..", "..", "..", ".."))
    candidates = [os.path.join(repo, relpath),  # bazel test: the runfiles tree
                  os.path.join(repo, "bazel-bin", relpath)]
    if os.environ.get("MUOND_BIN_DIR"):
        candidates.insert(0, os.path.join(os.environ["MUOND_BIN_DIR"], relpath))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"{relpath} not found (looked at {candidates}); "
                            "bazel build //server/daemon:muond-daemon //server/coordinator:"
                            "muond-coordinator")


def find_binaries(test) -> tuple[str, str]:
    """(coordinator, daemon) for a unittest `test` (or class), skipped, saying
    how to get them, when they are not built (the documented plain
    `unittest discover` run outside Bazel, before any bazel build)."""
    try:
        return (_find_binary("server/coordinator/muond-coordinator"),
                _find_binary("server/daemon/muond-daemon"))
    except FileNotFoundError as e:
        raise unittest.SkipTest(
            f"{e}; or run `bazel test //tests/client/python/...`, which builds them") from e


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    """The file's stripped text; "" while it does not exist."""
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


class Cluster:
    """A coordinator + `num_daemons` host daemons of job `job_id`.

    `daemons`: the daemons' addresses in rank order (``unix://...``, or
    ``127.0.0.1:PORT`` with ``tcp=True``). `token`: the job's shared token
    (the daemons and the coordinator read it from a 0600 file; "" with
    ``token=False``); on a TCP listener a trainer must send it, on a Unix
    socket the file mode guards. `coordinator`: its ``127.0.0.1:PORT``.
    """

    def __init__(self, num_daemons: int = 1, *, tcp: bool = False, token: bool = True,
                 job_id: str | None = None, comm_timeout_s: int = 20, extra_daemon_args=(),
                 coordinator_args=(), daemon_args_of=None, daemon_preexec_fn=None):
        if tcp and not token:
            raise ValueError("a TCP daemon needs a token")
        self.num_daemons = num_daemons
        self.tcp = tcp
        # Unique across parallel runs: sandboxes may share /dev/shm, where the
        # client's shm names include the job.
        self.job_id = job_id or f"contract{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.token = uuid.uuid4().hex if token else ""
        self.comm_timeout_s = comm_timeout_s
        self.extra_daemon_args = list(extra_daemon_args)
        self.coordinator_args = list(coordinator_args)
        # rank -> extra args of that daemon alone (e.g. its --metrics_port).
        self.daemon_args_of = daemon_args_of or (lambda rank: [])
        # Runs in each daemon process before exec (e.g. to lower its limits).
        self.daemon_preexec_fn = daemon_preexec_fn
        self.tmp = None
        self.daemons: list[str] = []
        self.coordinator = ""
        self._procs: list[tuple[str, subprocess.Popen, object]] = []

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> "Cluster":
        self.tmp = tempfile.mkdtemp(prefix="muond-contract-")
        try:
            self._start()
        except BaseException:
            self.stop(print_logs=True, check_shm=False)
            raise
        return self

    def _start(self):
        from muond.client import Client  # the caller's sys.path has client/python

        token_args = []
        if self.token:
            token_file = os.path.join(self.tmp, "token")
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token)
            token_args = [f"--token_file={token_file}"]
        port_file = os.path.join(self.tmp, "port")
        # Automatic rebalancing off: a plan change mid-test is not under test.
        self._spawn("coordinator", [
            _find_binary("server/coordinator/muond-coordinator"), "--listen=127.0.0.1:0",
            f"--port_file={port_file}", *token_args,
            "--rebalance_threshold=0", *self.coordinator_args])
        port = wait_for(lambda: self._check_alive() and _read(port_file), 20,
                        "the coordinator's port file")
        self.coordinator = f"127.0.0.1:{int(port)}"
        daemon = _find_binary("server/daemon/muond-daemon")
        for r in range(self.num_daemons):
            address = (f"127.0.0.1:{free_tcp_port()}" if self.tcp
                       else f"unix://{os.path.join(self.tmp, f'd{r}.sock')}")
            self.daemons.append(address)
            self._spawn(f"muond-rank{r}", [
                daemon, "--host", f"--coordinator={self.coordinator}",
                f"--job_id={self.job_id}", f"--rank={r}", f"--world_size={self.num_daemons}",
                f"--listen={address}", *token_args,
                f"--comm_timeout_s={self.comm_timeout_s}", "--coordinator_timeout_s=20",
                *self.extra_daemon_args, *self.daemon_args_of(r)],
                preexec_fn=self.daemon_preexec_fn)
        for address in self.daemons:
            self._check_alive()
            client = self.client(address)
            try:
                client.wait_healthy(20)
            finally:
                client.close()

    def client(self, address: str, **kw):
        """A muond.client.Client of `address`, with the job's token on TCP."""
        from muond.client import Client
        if self.tcp:
            kw.setdefault("token", self.token)
        return Client(address, timeout=kw.pop("timeout", 10), **kw)

    def process(self, name: str) -> subprocess.Popen:
        """The server process `name` ("coordinator", "muond-rank<R>"), e.g. to
        signal it; stop() still reaps it."""
        for n, proc, _ in self._procs:
            if n == name:
                return proc
        raise KeyError(name)

    def _spawn(self, name: str, argv, preexec_fn=None):
        log = open(os.path.join(self.tmp, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=preexec_fn)
        self._procs.append((name, proc, log))

    def _check_alive(self) -> bool:
        """True; raises when a server exited (a bad flag, a taken port)."""
        for name, proc, _ in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} at start")
        return True

    def logs(self, tail: int = 3000) -> str:
        out = []
        for name, _, log in self._procs:
            log.flush()
            with open(log.name, errors="replace") as f:
                out.append(f"---- {name} ----\n{f.read()[-tail:]}")
        return "\n".join(out)

    def stop(self, print_logs: bool = False, check_shm: bool = True):
        """Stops the servers, then removes the job's shm objects left by
        processes that are gone; with `check_shm` (a run that is not failing
        already) any such object is an AssertionError."""
        for _, proc, _ in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if print_logs and self._procs:
            sys.stderr.write(self.logs() + "\n")
        for _, _, log in self._procs:
            log.close()
        self._procs = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        left = self.remove_dead_shm()
        if left and check_shm:
            raise AssertionError(
                f"job {self.job_id}: {len(left)} shm object(s) left by processes that ended "
                "without unlinking them (removed now): " + ", ".join(left))

    def remove_dead_shm(self) -> list[str]:
        """Removes the job's shm objects (muond.shm names them
        /muond-<job>-<pid>-...) whose creator is gone, as `muond launch`
        does at its end; the paths removed. A live creator's are its own to
        unlink (an optimizer still open in this process)."""
        from muond.launch.processes import remove_dead_shm  # the caller's sys.path
        return remove_dead_shm(self.job_id)

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, *exc):
        self.stop(print_logs=exc_type is not None, check_shm=exc_type is None)


class ClusterTestCase(unittest.TestCase):
    """One cluster for the whole class (`NUM_DAEMONS` daemons, `TCP`,
    `EXTRA_DAEMON_ARGS`): the tests register, step and close their
    optimizers one after another on it. The servers' logs are printed when
    any test of the class failed."""

    NUM_DAEMONS = 1
    TCP = False
    DAEMON_PREEXEC_FN = None  # Cluster's daemon_preexec_fn (a staticmethod)
    EXTRA_DAEMON_ARGS = ()  # flags every daemon of the class gets

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        find_binaries(cls)  # skips the class, saying how to build them, when missing
        cls.cluster = Cluster(cls.NUM_DAEMONS, tcp=cls.TCP,
                              extra_daemon_args=cls.EXTRA_DAEMON_ARGS,
                              daemon_preexec_fn=cls.DAEMON_PREEXEC_FN).start()
        cls._failed = False

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop(print_logs=cls._failed, check_shm=not cls._failed)
        super().tearDownClass()

    def run(self, result=None):
        result = super().run(result)
        if result is not None and any(t is self for t, _ in result.errors + result.failures):
            type(self)._failed = True
        return result
