"""Several nodes, simulated on one machine (issue 21).

Two "nodes" of two host-mode `muond` daemons each (world 4, one job), the
`muond-coordinator` on node 0 over TCP with the job's token, and one trainer
per rank (tests/system/multinode_trainer.py, torchrun's environment) on its
rank's node, talking to its local daemon over a Unix socket. Each node's
daemons use `--gloo_hostname=<node address>` for their daemon-to-daemon
traffic and reach the coordinator at node 0's address.

Nodes are two network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2, nothing else reachable: an address or port that assumed 127.0.0.1
fails) when `ip netns` is permitted (root outside a sandbox: the Bazel target
is tagged `local`), else distinct loopback addresses (127.0.0.2 and
127.0.0.3); the test prints which mode ran and why.
$MUOND_MULTINODE_MODE=loopback forces the fallback.

Checked:
- two nodes, token over plain TCP, and two nodes with the coordinator on TLS
  (a certificate whose IP SAN is node 0's address; daemons with
  `--coordinator_tls_ca`) both equal the single-node run (the same job, all
  four daemons and trainers on 127.0.0.1) BITWISE: every rank's params and
  optimizer state (momentum, AdamW moments) after three steps; the params
  moved, and the plan's NS homes lie on both nodes (so Newton-Schulz inputs
  and updates crossed nodes);
- a node-1 daemon with the wrong token is refused by the coordinator and
  exits 1 naming it, and every trainer rank then fails with that rank named
  instead of waiting.
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
from cluster import find_binaries, wait_for  # noqa: E402

TRAINER = os.path.join(HERE, "multinode_trainer.py")
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


class Job:
    """The servers and trainers of one run on `nodes` (node k holds ranks
    k*PER_NODE ...), each node with its own directory (socket directory,
    token file copy: a mounted secret on a real node)."""

    def __init__(self, name: str, nodes: list[Node], root: str, token: str, *,
                 tls: bool = False):
        self.name, self.nodes, self.tls = name, nodes, tls
        self.dir = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
        self.job_id = f"mn{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.node_dirs = []
        for k in range(len(nodes)):
            d = os.path.join(self.dir, f"n{k}")
            os.makedirs(os.path.join(d, "run"), mode=0o700)
            _private_file(os.path.join(d, "token"), token)
            self.node_dirs.append(d)
        self.out = os.path.join(self.dir, "out")
        os.makedirs(self.out)
        self.coordinator = ""
        self.ca = ""
        self._procs: list[tuple[str, subprocess.Popen, str]] = []

    def node_of(self, rank: int) -> int:
        return rank // PER_NODE if len(self.nodes) > 1 else 0

    # -- processes --
    def spawn(self, name: str, node: int, argv: list[str], env=None) -> subprocess.Popen:
        path = os.path.join(self.dir, f"{name}.log")
        with open(path, "w") as log_file:
            proc = subprocess.Popen(self.nodes[node].wrap(argv), stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env)
        self._procs.append((name, proc, path))
        return proc

    def log_of(self, name: str) -> str:
        path = os.path.join(self.dir, f"{name}.log")
        with open(path, errors="replace") as f:
            return f.read()

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"---- {self.name} {name} (exit {proc.poll()}) ----\n"
                         f"{self.log_of(name)[-tail:]}" for name, proc, _ in self._procs)

    def stop(self) -> None:
        for _, proc, _ in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in self._procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def check_alive(self, names) -> bool:
        for name, proc, _ in self._procs:
            if name in names and proc.poll() is not None:
                raise RuntimeError(f"{self.name}: {name} exited with {proc.returncode}")
        return True

    # -- servers --
    def start_coordinator(self, coordinator_bin: str) -> None:
        addr = self.nodes[0].addr
        port_file = os.path.join(self.node_dirs[0], "port")
        args = [coordinator_bin, f"--listen={addr}:0", f"--port_file={port_file}",
                f"--token_file={self.node_dirs[0]}/token", "--rebalance_threshold=0"]
        if self.tls:
            cert, key = (os.path.join(self.node_dirs[0], n) for n in ("cert.pem", "key.pem"))
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={addr}",
                            "-addext", f"subjectAltName=IP:{addr}"],
                           check=True, capture_output=True)
            args += [f"--tls_cert={cert}", f"--tls_key={key}"]
            # The CA the other nodes get (a copy: their own filesystem).
            self.ca = os.path.join(self.dir, "coordinator-ca.pem")
            shutil.copy(cert, self.ca)
        self.spawn("coordinator", 0, args)
        port = wait_for(lambda: self.check_alive({"coordinator"}) and _read(port_file), 30,
                        f"{self.name}: the coordinator's port file")
        self.coordinator = f"{addr}:{int(port)}"

    def daemon_args(self, daemon_bin: str, rank: int, token_file: str | None = None):
        node = self.node_of(rank)
        args = [daemon_bin, "--host", f"--coordinator={self.coordinator}",
                f"--job_id={self.job_id}", f"--rank={rank}", f"--world_size={WORLD}",
                f"--listen={self.socket(rank)}",
                f"--token_file={token_file or os.path.join(self.node_dirs[node], 'token')}",
                f"--gloo_hostname={self.nodes[node].addr}", "--comm_timeout_s=30",
                "--coordinator_timeout_s=30"]
        if self.ca:
            args.append(f"--coordinator_tls_ca={self.ca}")
        return args

    def socket(self, rank: int) -> str:
        # The default socket name in the node's socket directory, which the
        # trainers' XDG_RUNTIME_DIR points at (muond.placement.discover).
        run = os.path.join(self.node_dirs[self.node_of(rank)], "run")
        return f"unix://{run}/muond/muond-{self.job_id}-{rank}.sock"

    def start_daemons(self, daemon_bin: str, ranks=range(WORLD), **kw) -> None:
        for rank in ranks:
            for d in self.node_dirs:
                os.makedirs(os.path.join(d, "run", "muond"), mode=0o700, exist_ok=True)
            self.spawn(f"muond-rank{rank}", self.node_of(rank),
                       self.daemon_args(daemon_bin, rank, **kw))

    def wait_daemons_healthy(self) -> None:
        from muond.client import Client
        names = {f"muond-rank{r}" for r in range(WORLD)} | {"coordinator"}
        for rank in range(WORLD):
            client = Client(self.socket(rank), timeout=10)
            try:
                wait_for(lambda: self.check_alive(names) and _healthy(client), 30,
                         f"{self.name}: daemon {rank} healthy")
            finally:
                client.close()

    # -- trainers --
    def start_trainers(self, master_port: int) -> list[subprocess.Popen]:
        procs = []
        for rank in range(WORLD):
            node = self.node_of(rank)
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                       LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE),
                       MASTER_ADDR=self.nodes[0].addr, MASTER_PORT=str(master_port),
                       MUOND_JOB_ID=self.job_id, MUOND_COORDINATOR=self.coordinator,
                       MUOND_TOKEN_FILE=os.path.join(self.node_dirs[node], "token"),
                       XDG_RUNTIME_DIR=os.path.join(self.node_dirs[node], "run"),
                       OMP_NUM_THREADS="1")
            env.pop("MUOND_DAEMON", None)
            if self.nodes[node].ifname:
                env["GLOO_SOCKET_IFNAME"] = self.nodes[node].ifname
            argv = [sys.executable, TRAINER, self.out] + ([self.ca] if self.ca else [])
            procs.append(self.spawn(f"trainer-rank{rank}", node, argv, env))
        return procs

    def wait_trainers(self, procs, timeout: float = 150) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                raise TimeoutError(f"{self.name}: trainers still running after {timeout:.0f}s")
        return [p.returncode for p in procs]

    def results(self) -> list[dict]:
        return [torch.load(os.path.join(self.out, f"rank{r}.pt")) for r in range(WORLD)]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _healthy(client) -> bool:
    try:
        return client.health(timeout=1).serving
    except Exception:  # noqa: BLE001 (not up yet: the socket is not there)
        return False


def _free_port(addr: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((addr if addr.startswith("127.") else "127.0.0.1", 0))
        return s.getsockname()[1]


# -- the test ------------------------------------------------------------------------
class MultiNodeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.coordinator_bin, cls.daemon_bin = find_binaries(cls)
        cls.root = tempfile.mkdtemp(prefix="muond-mn-", dir="/tmp")
        cls.token = uuid.uuid4().hex
        cls.topology = Topology()
        try:
            cls.topology.open()
        except BaseException:
            cls.topology.close()
            raise
        log(f"mode {cls.topology.mode}: {cls.topology.reason}; nodes "
            f"{[n.addr for n in cls.topology.nodes]}")
        # A SIGTERM (bazel's timeout) still runs the cleanup below.
        cls._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)

    @classmethod
    def tearDownClass(cls):
        cls.topology.close()
        shutil.rmtree(cls.root, ignore_errors=True)
        signal.signal(signal.SIGTERM, cls._old_sigterm)

    def run_job(self, name: str, nodes: list[Node], tls: bool = False) -> list[dict]:
        job = Job(name, nodes, self.root, self.token, tls=tls)
        started = time.monotonic()
        try:
            job.start_coordinator(self.coordinator_bin)
            job.start_daemons(self.daemon_bin)
            job.wait_daemons_healthy()
            codes = job.wait_trainers(job.start_trainers(_free_port(nodes[0].addr)))
            self.assertEqual(codes, [0] * WORLD, f"{name}: trainer exit codes\n{job.logs()}")
            results = job.results()
        except BaseException:
            job.stop()
            sys.stderr.write(job.logs() + "\n")
            raise
        job.stop()
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

    def check_crossed_nodes(self, results: list[dict], what: str) -> None:
        for rank, r in enumerate(results):
            for key, value in r["params"].items():
                self.assertFalse(torch.equal(value, r["initial"][key]),
                                 f"{what}: rank {rank} {key} never moved")
        homes = results[0]["homes"]
        # g is the node: rank = g * T + t with T = PER_NODE.
        self.assertEqual({g for _, g, _ in homes}, set(range(NODES)),
                         f"{what}: NS homes {homes} do not span both nodes")

    def test_two_nodes_equal_one_node_bitwise(self):
        single = self.run_job("single", [Node("127.0.0.1")])
        self.check_crossed_nodes(single, "single")
        nodes = self.topology.nodes
        for name, tls in (("two-nodes-token", False), ("two-nodes-tls", True)):
            with self.subTest(name):
                results = self.run_job(name, nodes, tls=tls)
                self.check_crossed_nodes(results, name)
                self.assert_bitwise(results, single, f"{name} ({self.topology.mode})")

    def test_wrong_token_is_refused_and_no_rank_waits(self):
        job = Job("wrong-token", self.topology.nodes, self.root, self.token)
        try:
            job.start_coordinator(self.coordinator_bin)
            wrong = _private_file(os.path.join(job.node_dirs[1], "wrong-token"), "not-the-token")
            job.start_daemons(self.daemon_bin, range(WORLD - 1))
            job.start_daemons(self.daemon_bin, [WORLD - 1], token_file=wrong)
            bad = job._procs[-1][1]
            bad.wait(timeout=60)
            self.assertEqual(bad.returncode, 1, job.logs())
            message = job.log_of(f"muond-rank{WORLD - 1}")
            self.assertIn("Join refused", message)
            self.assertIn("token", message.lower())
            job.check_alive({f"muond-rank{r}" for r in range(WORLD - 1)} | {"coordinator"})
            codes = job.wait_trainers(job.start_trainers(_free_port(self.topology.nodes[0].addr)))
            self.assertTrue(all(c != 0 for c in codes), f"trainer exit codes {codes}")
            for rank in range(WORLD):
                self.assertIn(f"rank {WORLD - 1}", job.log_of(f"trainer-rank{rank}"),
                              f"trainer {rank} does not name the refused rank\n{job.logs()}")
        except BaseException:
            sys.stderr.write(job.logs() + "\n")
            raise
        finally:
            job.stop()


def _raise_exit(signum, frame):
    raise SystemExit(f"signal {signum}")


if __name__ == "__main__":
    unittest.main()
