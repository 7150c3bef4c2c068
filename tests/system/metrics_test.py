"""The servers' Prometheus endpoint, scraped and parsed with
prometheus_client's text parser after a real run: a coordinator and 2 host
daemons with --metrics_port, one muond.torch.Muon trainer (split mode, 1 x 2
domain: both daemons hold a shard of every matrix) running N steps and then
one step with a NaN gradient, which every daemon refuses (INVALID_ARGUMENT:
non-finite gradients carry no ErrorReason).

Every value is checked against what the test ran or what the servers report
by RPC: steps applied N, refused 1 by reason, each phase histogram's count N
(a refused step is not timed: it ends before its phases), the plan version
(the daemons' GetStatus, the coordinator's GetPlan), the NS load shares (sum
to 1 over the daemons, equal to the coordinator's per rank), registrations,
registered params, and the exchange bytes (rank 0 sends what rank 1
receives). Also: without --metrics_port no server listens on anything more
than without metrics, and a busy --metrics_port fails the start naming the
flag.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import unittest
import urllib.error
import urllib.request
import uuid

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

import muond
from muond.torch import Muon
from muond.v1 import muond_pb2 as pb
from muond.v1 import muond_pb2_grpc as pb_grpc

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python", "contract"))
from cluster import Cluster, _find_binary, _read, free_tcp_port, wait_for  # noqa: E402

STEPS = 3
PHASES = ("momentum", "a2a_fwd", "ns", "a2a_bwd", "dp_share", "update", "total")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return r.read().decode()


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of the exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    return metrics[(name, frozenset(labels.items()))]


def listening_tcp_ports(pid: int) -> set:
    """The TCP ports process `pid` listens on (/proc/net/tcp{,6} LISTEN
    sockets whose inode is one of its fds)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class MetricsSystemTest(unittest.TestCase):
    def setUp(self):
        self.job = f"metrics{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.coordinator_port = free_tcp_port()
        self.daemon_ports = [free_tcp_port() for _ in range(2)]
        self.cluster = Cluster(
            2, token=False, job_id=self.job,
            coordinator_args=[f"--metrics_port={self.coordinator_port}"],
            daemon_args_of=lambda r: [f"--metrics_port={self.daemon_ports[r]}"]).start()
        self.addCleanup(self.cluster.stop)

    def run(self, result=None):
        result = super().run(result)
        cluster = getattr(self, "cluster", None)  # None: start failed (it printed the logs)
        if cluster and result and any(t is self for t, _ in result.errors + result.failures):
            sys.stderr.write(cluster.logs() + "\n")
        return result

    def refused_on(self, port: int):
        """The daemon's INVALID_ARGUMENT refusals (0 until the first one)."""
        return samples(scrape(port))[
            ("muond_steps_refused_total", frozenset({("reason", "INVALID_ARGUMENT")}))]

    def test_metrics_match_the_run(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False),
                                    torch.nn.Linear(32, 8, bias=False))
        opt = Muon(model.parameters(), lr=0.02, job_id=self.job, gtp_size=1, tp_size=2,
                   daemons=self.cluster.daemons)
        try:
            for _ in range(STEPS):
                opt.zero_grad()
                model(torch.randn(4, 16)).square().mean().backward()
                opt.step()
            opt.zero_grad()
            model(torch.randn(4, 16)).square().mean().backward()
            model[0].weight.grad.fill_(float("nan"))
            with self.assertRaises(RuntimeError) as refused:
                opt.step()
            self.assertIn("non-finite", str(refused.exception))
            statuses = opt.status()
            # The daemon that answered second may count its refusal after
            # the trainer raised: wait until both have (no value assumed).
            for port in self.daemon_ports:
                wait_for(lambda: self.refused_on(port), 20,
                         f"the refused step on the daemon with metrics port {port}")
            daemons = [samples(scrape(p)) for p in self.daemon_ports]
            coordinator = samples(scrape(self.coordinator_port))
        finally:
            opt.close()
        with grpc.insecure_channel(self.cluster.coordinator) as channel:
            plan = pb_grpc.CoordinatorStub(channel).GetPlan(pb.GetPlanRequest(job_id=self.job))

        loads = []
        for rank, (m, status) in enumerate(zip(daemons, statuses)):
            with self.subTest(rank=rank):
                self.assertEqual(value(m, "muond_build_info", version=muond.__version__), 1)
                self.assertEqual(value(m, "muond_steps_applied_total"), STEPS)
                refused = {dict(k[1])["reason"]: v for k, v in m.items()
                           if k[0] == "muond_steps_refused_total"}
                # Every reason is a series from the start (for rate()): the
                # one refusal counted, every other reason at 0.
                self.assertEqual(refused.pop("INVALID_ARGUMENT"), 1)
                self.assertIn("PEER_GONE", refused)
                self.assertIn("NONFINITE_SKIPPED", refused)
                self.assertEqual(set(refused.values()), {0})
                for phase in PHASES:
                    # The refused step ends before its phases: not timed.
                    self.assertEqual(
                        value(m, "muond_step_phase_seconds_count", phase=phase), STEPS)
                    self.assertEqual(value(m, "muond_step_phase_seconds_bucket", phase=phase,
                                           le="+Inf"), STEPS)
                self.assertGreater(value(m, "muond_step_phase_seconds_sum", phase="total"), 0)
                self.assertGreater(value(m, "muond_ns_seconds_total"), 0)
                self.assertEqual(value(m, "muond_plan_version"), status.plan_version)
                self.assertEqual(value(m, "muond_plan_version"), plan.version)
                self.assertEqual(value(m, "muond_registrations_total", result="accepted"), 1)
                self.assertEqual(value(m, "muond_registrations_total", result="refused"), 0)
                self.assertEqual(value(m, "muond_registered_params"), status.num_params)
                self.assertEqual(value(m, "muond_registered_params"), 2)  # a shard of each
                self.assertEqual(value(m, "muond_engine_build_failures_total"), 0)
                load = value(m, "muond_ns_load")
                self.assertGreater(load, 0)
                self.assertAlmostEqual(
                    load, value(coordinator, "muond_coordinator_ns_load", job=self.job,
                                rank=str(rank)), places=12)
                loads.append(load)
        self.assertAlmostEqual(sum(loads), 1, places=12)
        sent0 = value(daemons[0], "muond_exchange_bytes_total", direction="sent")
        self.assertGreater(sent0, 0)
        self.assertEqual(sent0,
                         value(daemons[1], "muond_exchange_bytes_total", direction="received"))
        self.assertEqual(value(daemons[1], "muond_exchange_bytes_total", direction="sent"),
                         value(daemons[0], "muond_exchange_bytes_total", direction="received"))

        c = coordinator
        self.assertEqual(value(c, "muond_build_info", version=muond.__version__), 1)
        self.assertEqual(value(c, "muond_coordinator_jobs"), 1)
        self.assertEqual(value(c, "muond_coordinator_daemons", job=self.job), 2)
        self.assertEqual(value(c, "muond_coordinator_plan_version", job=self.job), plan.version)
        self.assertEqual(value(c, "muond_coordinator_plans_built_total", job=self.job), 1)
        self.assertEqual(value(c, "muond_coordinator_manifests_total", job=self.job), 2)
        # Created at 0 with the job (for rate()); no planning failed.
        self.assertEqual(value(c, "muond_coordinator_rebalances_total", job=self.job), 0)
        self.assertFalse([k for k in c if k[0] == "muond_coordinator_plan_build_failures_total"])

        # close() unregistered: no params, no active plan.
        for port in self.daemon_ports:
            m = samples(scrape(port))
            self.assertEqual(value(m, "muond_registered_params"), 0)
            self.assertEqual(value(m, "muond_plan_version"), 0)
            self.assertEqual(value(m, "muond_ns_load"), 0)

    def test_only_metrics_path_is_served(self):
        for path in ("/", "/metrics/x", "/other"):
            with self.assertRaises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{self.coordinator_port}{path}",
                                       timeout=10)
            self.assertEqual(e.exception.code, 404)
        # The cluster's servers listen on their gRPC port (the coordinator)
        # and the metrics port, nothing else over TCP before a registration.
        self.assertEqual(listening_tcp_ports(self.cluster.process("coordinator").pid),
                         {int(self.cluster.coordinator.rsplit(":", 1)[1]),
                          self.coordinator_port})
        self.assertEqual(listening_tcp_ports(self.cluster.process("muond-rank0").pid),
                         {self.daemon_ports[0]})


class MetricsOffByDefaultTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="muond-m-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.procs = []
        self.addCleanup(self.stop)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def spawn(self, argv):
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def test_no_flag_no_listener_and_busy_port_fails(self):
        port_file = os.path.join(self.tmp, "port")
        coordinator = self.spawn([_find_binary("server/coordinator/muond-coordinator"),
                                  "--listen=127.0.0.1:0", f"--port_file={port_file}"])
        grpc_port = int(wait_for(lambda: _read(port_file), 20, "the coordinator's port file"))
        socket_path = os.path.join(self.tmp, "d0.sock")
        daemon = self.spawn([_find_binary("server/daemon/muond-daemon"), "--host",
                             f"--coordinator=127.0.0.1:{grpc_port}", "--job_id=off",
                             "--rank=0", "--world_size=1", f"--listen=unix://{socket_path}"])
        wait_for(lambda: os.path.exists(socket_path), 20, "the daemon's socket")
        self.assertEqual(listening_tcp_ports(coordinator.pid), {grpc_port})
        self.assertEqual(listening_tcp_ports(daemon.pid), set())
        self.assertIsNone(coordinator.poll())
        self.assertIsNone(daemon.poll())

        # A busy --metrics_port (the coordinator's gRPC port) fails the start.
        for argv in ([_find_binary("server/coordinator/muond-coordinator"),
                      "--listen=127.0.0.1:0", f"--metrics_port={grpc_port}"],
                     [_find_binary("server/daemon/muond-daemon"), "--host",
                      f"--coordinator=127.0.0.1:{grpc_port}", "--job_id=busy", "--rank=0",
                      "--world_size=1", f"--listen=unix://{self.tmp}/d1.sock",
                      f"--metrics_port={grpc_port}"]):
            p = self.spawn(argv)
            _, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 1, err)
            self.assertIn(f"cannot serve metrics on 127.0.0.1:{grpc_port} "
                          "(--metrics_address/--metrics_port)", err)
            self.assertIn("Address already in use", err)  # the bind's own reason

    def test_sigterm_with_idle_connections_exits(self):
        """Open idle connections to /metrics do not hold a daemon's shutdown:
        SIGTERM ends it (exit 0) and closes them, well within 15 s."""
        port_file = os.path.join(self.tmp, "port")
        self.spawn([_find_binary("server/coordinator/muond-coordinator"),
                    "--listen=127.0.0.1:0", f"--port_file={port_file}"])
        grpc_port = int(wait_for(lambda: _read(port_file), 20, "the coordinator's port file"))
        metrics_port = free_tcp_port()
        daemon = self.spawn([_find_binary("server/daemon/muond-daemon"), "--host",
                             f"--coordinator=127.0.0.1:{grpc_port}", "--job_id=idle",
                             "--rank=0", "--world_size=1",
                             f"--listen=unix://{self.tmp}/d0.sock",
                             f"--metrics_port={metrics_port}"])
        wait_for(lambda: _scrapes(metrics_port), 20, "the daemon's /metrics")
        idle = []
        for partial in (b"", b"GET /metrics HTTP/1.1\r\n"):  # silent; a request's start
            s = socket.create_connection(("127.0.0.1", metrics_port), timeout=30)
            self.addCleanup(s.close)
            s.sendall(partial)
            idle.append(s)
        daemon.send_signal(signal.SIGTERM)
        try:
            _, err = daemon.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.fail("muond still running 15 s after SIGTERM with idle /metrics connections")
        self.assertEqual(daemon.returncode, 0, err)
        for s in idle:
            self.assertTrue(_closed_by_peer(s), "an idle /metrics connection left open")


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the server has closed s: an orderly FIN reads as b"", and a close
    with our unread partial request still in its buffer makes the kernel send RST."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _scrapes(port: int) -> bool:
    try:
        return bool(scrape(port))
    except OSError:
        return False


if __name__ == "__main__":
    unittest.main()
