"""`muond health` (muond/health.py, the exec probe of deploy/k8s) against
grpcio-health-checking's own HealthServicer on a Unix socket and on TCP:
any answer exits 0 (NOT_SERVING too), --serving only SERVING, --service
names the service asked about, and a server that is not there exits 1
naming the address (so is an unknown service with --serving).
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def muond_health(*args):
    return subprocess.run([sys.executable, "-m", "muond.cli", "health", "--timeout", "5", *args],
                          capture_output=True, text=True, timeout=60)


class HealthCliTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="mh-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.socket = os.path.join(self.tmp, "d.sock")
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.addCleanup(self.server.stop, None)

    def set(self, service, status):
        self.servicer.set(service, getattr(health_pb2.HealthCheckResponse, status))

    def test_any_answer_counts_serving_asks_for_serving(self):
        self.set("", "NOT_SERVING")
        for address in (self.socket, f"unix://{self.socket}", f"127.0.0.1:{self.port}"):
            proc = muond_health(address)
            self.assertEqual(proc.returncode, 0, proc.stderr)
            self.assertIn("NOT_SERVING", proc.stdout)
        proc = muond_health("--serving", self.socket)
        self.assertEqual(proc.returncode, 1)
        self.assertIn("--serving asks for SERVING", proc.stderr)
        self.set("", "SERVING")
        self.assertEqual(muond_health("--serving", self.socket, self.socket).returncode, 0)

    def test_service_name(self):
        self.set("", "NOT_SERVING")
        self.set("muond.v1.Optimizer", "SERVING")
        proc = muond_health("--serving", "--service", "muond.v1.Optimizer", self.socket)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        proc = muond_health("--serving", "--service", "no.such.Service", self.socket)
        self.assertEqual(proc.returncode, 1)  # NOT_FOUND: no answer for it

    def test_missing_server_named(self):
        missing = os.path.join(self.tmp, "gone.sock")
        proc = muond_health(self.socket, missing)
        self.assertEqual(proc.returncode, 1)
        self.assertIn(f"{missing}: no answer", proc.stderr)
        proc = muond_health("--timeout", "0", self.socket)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--timeout=0.0 must be > 0", proc.stderr)


if __name__ == "__main__":
    unittest.main()
