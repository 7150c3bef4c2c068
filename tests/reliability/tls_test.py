"""TLS on the coordinator's TCP listener (access control).

A self-signed certificate for 127.0.0.1 is made with the openssl CLI; the
coordinator serves with --tls_cert/--tls_key. A client that trusts the
certificate reaches the service (an unknown job answers NOT_FOUND, which only
the service itself can say); a plaintext client and a client that does not
trust the certificate never get past the handshake (UNAVAILABLE). muonctl with
--tls-ca reaches it too, and without it fails to connect.
"""
import os
import shutil
import subprocess
import tempfile
import time
import unittest

import grpc

from muond.v1 import muond_pb2, muond_pb2_grpc

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

COORDINATOR = os.path.join(RUNFILES, "server/coordinator/muond-coordinator")
MUONCTL = os.path.join(RUNFILES, "tools/muonctl/muonctl")


def read(path):
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().strip()


class TlsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-tls-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.cert = os.path.join(self.dir, "cert.pem")
        self.key = os.path.join(self.dir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", self.key, "-out", self.cert, "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        port_file = os.path.join(self.dir, "port")
        self.server = subprocess.Popen(
            [COORDINATOR, "--listen=127.0.0.1:0", f"--port_file={port_file}",
             f"--tls_cert={self.cert}", f"--tls_key={self.key}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(self.stop_server)
        deadline = time.time() + 20
        while not read(port_file):
            self.assertIsNone(self.server.poll(), "the coordinator exited")
            self.assertLess(time.time(), deadline, "no port file")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{read(port_file)}"

    def stop_server(self):
        self.server.terminate()
        self.server.wait(timeout=10)

    def list_daemons(self, channel):
        stub = muond_pb2_grpc.CoordinatorStub(channel)
        return stub.ListDaemons(muond_pb2.ListDaemonsRequest(job_id="no-such-job"), timeout=5)

    def test_trusted_client_reaches_the_service(self):
        with open(self.cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(self.address, creds) as channel:
            with self.assertRaises(grpc.RpcError) as ctx:
                self.list_daemons(channel)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.NOT_FOUND,
                         ctx.exception.details())

    def test_plaintext_and_untrusted_clients_are_refused(self):
        with grpc.insecure_channel(self.address) as channel:
            with self.assertRaises(grpc.RpcError) as ctx:
                self.list_daemons(channel)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)
        with grpc.secure_channel(self.address, grpc.ssl_channel_credentials()) as channel:
            with self.assertRaises(grpc.RpcError) as ctx:
                self.list_daemons(channel)
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)

    def test_muonctl_with_and_without_the_ca(self):
        trusted = subprocess.run([MUONCTL, "daemons", "--coordinator", self.address,
                                  "--job_id", "no-such-job", "--tls-ca", self.cert,
                                  "--timeout-s", "5"], capture_output=True, text=True)
        self.assertIn("unknown to this coordinator", trusted.stderr + trusted.stdout)
        plain = subprocess.run([MUONCTL, "daemons", "--coordinator", self.address,
                                "--job_id", "no-such-job", "--timeout-s", "5"],
                               capture_output=True, text=True)
        self.assertNotEqual(plain.returncode, 0)
        self.assertNotIn("unknown to this coordinator", plain.stderr + plain.stdout)


if __name__ == "__main__":
    unittest.main()
