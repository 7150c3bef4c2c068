"""Children that subprocess forks (not vfork: preexec_fn, process_group)
while a gRPC channel is busy start and exit cleanly once muond is imported:
the way muond's launcher and local cluster start servers and commands.
With gRPC's fork handlers on (grpcio's default) such children can abort
before their exec ("Check failed" in the epoll poller); importing muond
first turns them off."""
import subprocess
import sys
import textwrap
import unittest

CHILDREN = 300

SCRIPT = textwrap.dedent(f"""
    import muond  # before grpc, as a trainer or the launcher imports it
    import subprocess, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{{port}}"))
    done = threading.Event()
    def busy():
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    thread = threading.Thread(target=busy)
    thread.start()
    codes = [subprocess.run(["true"], preexec_fn=lambda: None, process_group=0).returncode
             for _ in range({CHILDREN})]
    done.set()
    thread.join()
    print(sum(code != 0 for code in codes))
""")


class ForkWithLiveChannelsTest(unittest.TestCase):
    def test_forked_children_exec_while_a_channel_is_busy(self):
        run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                             timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        self.assertEqual(run.stdout.strip(), "0",
                         f"children of {CHILDREN} that failed; stderr: {run.stderr[-2000:]}")


if __name__ == "__main__":
    unittest.main()
