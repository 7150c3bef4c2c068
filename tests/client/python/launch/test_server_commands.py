"""The servers' command lines for a launch layout (muond/launch/launcher.py
Launch.coordinator_command / daemon_command), written out by hand: no
process is started.
"""
import unittest

from muond.launch.config import resolve
from muond.launch.launcher import Launch
from tests.client.python.launch.options import options


class ServerCommandTest(unittest.TestCase):

    def launch(self, argv, env):
        a = options(*argv)
        layout = resolve(a, env, count_gpus=lambda: 0, resolve_host=lambda: "10.0.0.5",
                         new_job_id=lambda: "gen-1")
        launch = Launch(layout, a, "/b/muond-daemon", "/b/muond-coordinator")
        launch.sockdir, launch.token_file = "/tmp/s", "/tok"
        return launch

    def test_second_node_gpu_daemons(self):
        env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77",
               "SLURM_JOB_NODELIST": "gpu[001-002]", "MUOND_TOKEN_FILE": "/tok",
               "CUDA_VISIBLE_DEVICES": "4,6"}
        launch = self.launch(["--node-addr", "10.0.0.2", "--metrics-port", "9100",
                              "--metrics-address", "0.0.0.0",
                              "--log-format", "json", "--tls-ca", "/ca.pem",
                              "--daemon-arg=--comm_timeout_s=120"], env)
        self.assertFalse(launch.layout.start_coordinator)
        self.assertEqual(launch.daemon_command(3, 1, 1), [
            "/b/muond-daemon", "--job_id=slurm-77", "--rank=3", "--world_size=4",
            "--coordinator=gpu001:29400", "--listen=unix:///tmp/s/muond-slurm-77-3.sock",
            "--device=1", "--gloo_hostname=10.0.0.2", "--token_file=/tok", "--log_format=json",
            "--metrics_port=9102", "--metrics_address=0.0.0.0", "--coordinator_tls_ca=/ca.pem",
            "--comm_timeout_s=120"])

    def test_single_node_coordinator_and_host_daemon(self):
        launch = self.launch(["--device", "cpu", "--coordinator-arg=--max_jobs=2"], {})
        self.assertEqual(launch.coordinator_command("/tmp/s/coordinator.port"), [
            "/b/muond-coordinator", "--listen=127.0.0.1:0", "--token_file=/tok",
            "--port_file=/tmp/s/coordinator.port", "--max_jobs=2"])
        launch.coordinator = "127.0.0.1:4242"  # what the port file said
        self.assertEqual(launch.daemon_command(0, 0, None), [
            "/b/muond-daemon", "--job_id=gen-1", "--rank=0", "--world_size=1",
            "--coordinator=127.0.0.1:4242", "--listen=unix:///tmp/s/muond-gen-1-0.sock", "--host",
            "--gloo_hostname=127.0.0.1", "--token_file=/tok"])

    def test_tls_coordinator_on_node_zero(self):
        env = {"MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/tok"}
        launch = self.launch(["--nnodes", "2", "--node-rank", "0", "--device", "cpu",
                              "--master-addr", "10.0.0.1", "--node-addr", "10.0.0.1",
                              "--tls-cert", "/c.pem", "--tls-key", "/k.pem", "--tls-ca",
                              "/ca.pem", "--metrics-port", "9100"], env)
        self.assertEqual(launch.coordinator_command(None), [
            "/b/muond-coordinator", "--listen=10.0.0.1:29400", "--token_file=/tok",
            "--metrics_port=9100", "--tls_cert=/c.pem", "--tls_key=/k.pem"])


if __name__ == "__main__":
    unittest.main()
