"""Several nodes, simulated on one machine.

Two "nodes", each a `muond launch` (per-node mode: --nnodes 2 --node-rank k
--master-addr <node 0> --node-addr <node k> --job-id --token-file) of two
host-mode `muond-daemon`s (world 4, one job), the `muond-coordinator` on node
0 over TCP with the job's token, and the node's trainer ranks
(tests/system/multinode_trainer.py, torchrun's layout) each talking to its
local daemon over a Unix socket. The daemons use `--gloo_hostname=<node
address>` for their daemon-to-daemon traffic and reach the coordinator at node
0's address.

Nodes are two network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2, nothing else reachable: an address or port that assumed 127.0.0.1
fails) when `ip netns` is permitted (root outside a sandbox: the Bazel target
is tagged `local`), else distinct loopback addresses (127.0.0.2 and
127.0.0.3); the test prints which mode ran and why.
$MUOND_MULTINODE_MODE=loopback forces the fallback.

Checked:
- two nodes, token over plain TCP, and two nodes with the coordinator on TLS
  (a certificate whose IP SAN is node 0's address; the daemons verify it,
  `--tls-ca`) both equal the single-node run (the same job, one launcher of
  four daemons and trainers on 127.0.0.1) BITWISE: every rank's params and
  optimizer state (momentum, AdamW moments) after three steps; the params
  moved, and the plan's NS homes lie on both nodes (so Newton-Schulz inputs
  and updates crossed nodes);
- a node whose token is wrong: its daemons are refused at Join and its
  launcher exits 1 naming the daemon and the refusal.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import uuid
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python", "contract"))
from cluster import find_binaries  # noqa: E402

import muond  # noqa: E402

TRAINER = os.path.join(HERE, "multinode_trainer.py")
# The launcher and trainers import the muond this test imports (Bazel's
# //client/python, or the checkout's), not whichever one the venv holds.
MUOND_PATH = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
NETNS_PREFIX = "muond-mn-"
NETNS_SUBNET = "10.77.0"  # node k: 10.77.0.<k+1>/24, inside the namespaces only
STALE_NETNS_S = 1800  # a namespace of ours older than this is a crashed run's


def log(message: str) -> None:
    print(f"multinode_test: {message}", file=sys.stderr, flush=True)


# -- nodes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    addr: str             # this node's address: coordinator (node 0), Gloo, trainers' gloo
    netns: str | None = None
    ifname: str | None = None  # the trainers' GLOO_SOCKET_IFNAME

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run on this node."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


class Topology:
    """The two nodes: `mode` "netns" (two namespaces and a veth pair, made by
    `open` and removed by `close`, also after a failure) or "loopback"."""

    def __init__(self):
        self.mode, self.reason, self.nodes = "", "", []
        self._netns: list[str] = []
        self._veth = ""

    def open(self) -> "Topology":
        if os.environ.get("MUOND_MULTINODE_MODE") == "loopback":
            return self._loopback("MUOND_MULTINODE_MODE=loopback")
        if shutil.which("ip") is None:
            return self._loopback("no `ip` command (iproute2)")
        try:
            self._make_netns()
        except OSError as e:
            self.close()
            return self._loopback(f"ip netns is not permitted here ({e})")
        self.mode = "netns"
        self.reason = f"namespaces {self._netns} joined by veth {self._veth}"
        return self

    def _loopback(self, reason: str) -> "Topology":
        self.mode, self.reason = "loopback", reason
        self.nodes = [Node(f"127.0.0.{k + 2}") for k in range(NODES)]
        return self

    def _make_netns(self) -> None:
        _sweep_stale_netns()
        tag = uuid.uuid4().hex[:8]
        self._netns = [f"{NETNS_PREFIX}{tag}-{k}" for k in range(NODES)]
        ifnames = [f"mn{tag}{k}" for k in range(NODES)]  # <= 15 characters
        for ns in self._netns:
            _ip("netns", "add", ns)
        _ip("link", "add", ifnames[0], "type", "veth", "peer", "name", ifnames[1])
        self._veth = ifnames[0]
        for k, (ns, ifname) in enumerate(zip(self._netns, ifnames)):
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{NETNS_SUBNET}.{k + 1}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.nodes.append(Node(f"{NETNS_SUBNET}.{k + 1}", ns, ifname))
        # `ip netns exec` itself (a mount namespace, /sys remounted) may be
        # refused where `ip netns add` was not.
        probe = subprocess.run(self.nodes[1].wrap(["true"]), capture_output=True, text=True)
        if probe.returncode != 0:
            raise OSError(f"ip netns exec: {probe.stderr.strip() or probe.returncode}")

    def close(self) -> None:
        """Removes the namespaces (their veth ends, and so the pair, with them)."""
        for ns in self._netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._veth:
            subprocess.run(["ip", "link", "del", self._veth], capture_output=True)
        self._netns, self._veth = [], ""


def _sweep_stale_netns() -> None:
    """Namespaces of a run that was killed before its cleanup (SIGKILL)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        path = os.path.join("/run/netns", name)
        try:
            stale = (name.startswith(NETNS_PREFIX) and
                     time.time() - os.stat(path).st_mtime > STALE_NETNS_S)
        except OSError:
            continue
        if stale:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# -- one job -----------------------------------------------------------------------
def _private_file(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _free_port(addr: str) -> int:
    """A port free on `addr` (any port is free on a fresh namespace's address)."""
    import socket
    with socket.socket() as s:
        s.bind((addr if addr.startswith("127.") else "127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One run: a `muond launch` per node (node k: daemon ranks k*PER_NODE
    ...; node 0 also the coordinator) running this node's trainers. Each node
    has its own directory (its copy of the token file: a mounted secret on a
    real node; its logs)."""

    def __init__(self, name: str, nodes: list[Node], root: str, token: str, bin_dir: str, *,
                 tls: bool = False):
        self.name, self.nodes, self.bin_dir = name, nodes, bin_dir
        self.dir = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
        self.job_id = f"mn{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.node_dirs = []
        for k in range(len(nodes)):
            d = os.path.join(self.dir, f"n{k}")
            os.makedirs(d, mode=0o700)
            _private_file(os.path.join(d, "token"), token)
            self.node_dirs.append(d)
        self.out = os.path.join(self.dir, "out")
        os.makedirs(self.out)
        self.port = _free_port(nodes[0].addr)         # the coordinator
        self.master_port = _free_port(nodes[0].addr)  # the trainers' torch.distributed
        self.cert = self.key = self.ca = None
        if tls:
            self._make_cert()
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def _make_cert(self) -> None:
        """The coordinator's self-signed certificate for node 0's address (IP
        SAN: the daemons dial the address, so gRPC checks it there), and its
        copy as every node's CA file."""
        addr = self.nodes[0].addr
        self.cert, self.key = (os.path.join(self.node_dirs[0], n) for n in ("cert.pem", "key.pem"))
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        self.key, "-out", self.cert, "-days", "1", "-subj", f"/CN={addr}",
                        "-addext", f"subjectAltName=IP:{addr}"], check=True, capture_output=True)
        self.ca = os.path.join(self.dir, "coordinator-ca.pem")
        shutil.copy(self.cert, self.ca)

    def launch_argv(self, k: int, command: list[str], token_file: str | None = None) -> list:
        argv = [sys.executable, "-m", "muond.cli", "launch", "--device", "cpu",
                "--nnodes", str(len(self.nodes)), "--node-rank", str(k),
                "--nproc-per-node", str(WORLD // len(self.nodes)),
                "--master-addr", self.nodes[0].addr, "--node-addr", self.nodes[k].addr,
                "--coordinator-port", str(self.port), "--job-id", self.job_id,
                "--token-file", token_file or os.path.join(self.node_dirs[k], "token"),
                "--bin-dir", self.bin_dir, "--log-dir", os.path.join(self.node_dirs[k], "logs"),
                "--daemon-arg=--comm_timeout_s=30", "--coordinator-arg=--rebalance_threshold=0"]
        if self.ca:
            argv += ["--tls-ca", self.ca]
            if k == 0:
                argv += ["--tls-cert", self.cert, "--tls-key", self.key]
        return [*argv, "--", *command]

    def trainer_command(self) -> list[str]:
        return [sys.executable, TRAINER, self.out] + ([self.ca] if self.ca else [])

    def start(self, k: int, command: list[str], **kw) -> subprocess.Popen:
        env = dict(os.environ, MASTER_PORT=str(self.master_port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([MUOND_PATH, os.environ.get("PYTHONPATH", "")]))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MUOND_DAEMON", "MUOND_JOB_ID",
                    "MUOND_TOKEN_FILE", "MUOND_SOCKET_DIR", "SLURM_PROCID"):
            env.pop(var, None)  # the launcher's own layout, not the test runner's
        if self.nodes[k].ifname:  # gloo's interface: the host name resolves off-namespace
            env["GLOO_SOCKET_IFNAME"] = self.nodes[k].ifname
        with open(self.launcher_log(k), "w") as log_file:
            proc = subprocess.Popen(self.nodes[k].wrap(self.launch_argv(k, command, **kw)),
                                    stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.node_dirs[k])
        self._procs.append((f"launcher node {k}", proc))
        return proc

    def launcher_log(self, k: int) -> str:
        return os.path.join(self.node_dirs[k], "launcher.log")

    def wait(self, procs, timeout: float = 240) -> list[int]:
        """Every process's exit status; kills them all after `timeout` s."""
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"{self.name}: launchers still running after {timeout:.0f}s")
        return [p.returncode for p in procs]

    def stop(self) -> None:
        """SIGTERM (the launcher stops its command and servers), SIGKILL later."""
        for _, proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self, tail: int = 3000) -> str:
        out = []
        for k, d in enumerate(self.node_dirs):
            paths = [self.launcher_log(k)] + sorted(
                os.path.join(d, "logs", n) for n in os.listdir(os.path.join(d, "logs"))
            ) if os.path.isdir(os.path.join(d, "logs")) else [self.launcher_log(k)]
            for path in paths:
                with open(path, errors="replace") as f:
                    out.append(f"---- {self.name} node {k}: {path} ----\n{f.read()[-tail:]}")
        return "\n".join(out)

    def results(self) -> list[dict]:
        return [torch.load(os.path.join(self.out, f"rank{r}.pt")) for r in range(WORLD)]


# -- the test ------------------------------------------------------------------------
class MultiNodeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        coordinator_bin, _ = find_binaries(cls)
        # The tree holding server/daemon/muond-daemon and server/coordinator/... .
        cls.bin_dir = os.path.dirname(os.path.dirname(os.path.dirname(coordinator_bin)))
        cls.root = tempfile.mkdtemp(prefix="muond-mn-", dir="/tmp")
        cls.token = uuid.uuid4().hex
        cls.topology = Topology()
        # A SIGTERM (bazel's timeout) still runs the cleanup in tearDownClass.
        cls._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            cls.topology.open()
        except BaseException:
            cls.tearDownClass()
            raise
        log(f"mode {cls.topology.mode}: {cls.topology.reason}; nodes "
            f"{[n.addr for n in cls.topology.nodes]}")

    @classmethod
    def tearDownClass(cls):
        cls.topology.close()
        shutil.rmtree(cls.root, ignore_errors=True)
        signal.signal(signal.SIGTERM, cls._old_sigterm)

    def job(self, name: str, nodes: list[Node], **kw) -> Job:
        return Job(name, nodes, self.root, self.token, self.bin_dir, **kw)

    def run_job(self, name: str, nodes: list[Node], tls: bool = False) -> list[dict]:
        job = self.job(name, nodes, tls=tls)
        started = time.monotonic()
        try:
            codes = job.wait([job.start(k, job.trainer_command()) for k in range(len(nodes))])
            self.assertEqual(codes, [0] * len(nodes), f"{name}: launcher exit statuses")
            results = job.results()
        except BaseException:
            job.stop()
            sys.stderr.write(job.logs() + "\n")
            raise
        log(f"{name}: {time.monotonic() - started:.1f}s")
        return results

    def assert_bitwise(self, got: list[dict], want: list[dict], what: str) -> None:
        for rank, (g, w) in enumerate(zip(got, want)):
            for kind in ("params", "state"):
                self.assertEqual(sorted(g[kind]), sorted(w[kind]), f"{what} rank {rank} {kind}")
                for key, value in w[kind].items():
                    self.assertTrue(torch.equal(g[kind][key], value),
                                    f"{what}: rank {rank} {kind} {key} differs from the "
                                    f"single-node run by up to "
                                    f"{(g[kind][key] - value).abs().max().item()}")

    def check_moved_and_crossed(self, results: list[dict], what: str) -> None:
        for rank, r in enumerate(results):
            for key, value in r["params"].items():
                self.assertFalse(torch.equal(value, r["initial"][key]),
                                 f"{what}: rank {rank} {key} never moved")
            self.assertTrue(r["state"], f"{what}: rank {rank} has no optimizer state")
        homes = results[0]["homes"]
        # g is the node: rank = g * T + t with T = PER_NODE.
        self.assertEqual({g for _, g, _ in homes}, set(range(NODES)),
                         f"{what}: NS homes {homes} do not span both nodes")

    def test_two_nodes_equal_one_node_bitwise(self):
        single = self.run_job("single", [Node("127.0.0.1")])
        self.check_moved_and_crossed(single, "single")
        for name, tls in (("two-nodes-token", False), ("two-nodes-tls", True)):
            with self.subTest(name):
                results = self.run_job(name, self.topology.nodes, tls=tls)
                self.check_moved_and_crossed(results, name)
                self.assert_bitwise(results, single, f"{name} ({self.topology.mode})")

    def test_wrong_token_node_is_refused_naming_the_daemon(self):
        """Node 1's launcher with another token: the coordinator refuses its
        daemons' Join, they exit 1 naming it and the launcher exits 1 naming
        the daemon, without running node 1's trainers. (Node 0's trainers
        would wait for their peers until their own timeouts: ending a job
        whose node failed is the scheduler's part, e.g. srun
        --kill-on-bad-exit; here the test stops node 0's launcher.)"""
        job = self.job("wrong-token", self.topology.nodes)
        wrong = _private_file(os.path.join(job.node_dirs[1], "wrong-token"), "not-the-token")
        try:
            node0 = job.start(0, [sys.executable, "-c", "import time; time.sleep(600)"])
            node1 = job.start(1, job.trainer_command(), token_file=wrong)
            self.assertEqual(job.wait([node1]), [1])
            with open(job.launcher_log(1)) as f:
                said = f.read()
            self.assertRegex(said, r"daemon rank [23] \(pid \d+\) exit status 1")
            self.assertIn("Join refused", said)
            self.assertIn("token", said.lower())
            self.assertEqual(os.listdir(job.out), [], "node 1's trainers ran")
            self.assertIsNone(node0.poll(), "node 0's launcher ended by itself")
        except BaseException:
            job.stop()
            sys.stderr.write(job.logs() + "\n")
            raise
        job.stop()
        self.assertEqual(node0.returncode, 128 + signal.SIGTERM, job.logs())


def _raise_exit(signum, frame):
    raise SystemExit(f"signal {signum}")


if __name__ == "__main__":
    unittest.main()
