"""The one GPU setup of the Python GPU checks and benchmarks (tests/gpu,
bench/gpu_step_bench.py, bench/gpu_dropin_bench.py, bench/rpc_overhead.py):
`cuda_or_skip()` decides whether a GPU check runs, and `Daemon` starts a
muond-coordinator and one muond-daemon (on a GPU, or in host mode with
host=True) and stops both on exit.

Binaries come from $MUOND_BIN (a GPU bundle's bin/, deploy/bundle.sh) or
bazel-bin. `Daemon` is a context manager; `.address` is the daemon's socket.
It lives in tests/gpu because deploy/bundle.sh ships that folder to GPU hosts.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_or_skip() -> bool:
    """True when torch sees a CUDA device; else prints the SKIP line that the GPU
    checks report (their Bazel targets then pass on a host without a GPU)."""
    import torch
    if torch.cuda.is_available():
        return True
    print("SKIP: no CUDA device")
    return False


def _binary(rel: str) -> str:
    bin_dir = os.environ.get("MUOND_BIN", os.path.join(ROOT, "bazel-bin"))
    flat = os.path.join(bin_dir, os.path.basename(rel))
    return flat if os.path.isfile(flat) else os.path.join(bin_dir, rel)


def report(failures: list) -> int:
    """Prints each failure and PASS or FAIL; the test's exit code."""
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


class Daemon:
    def __init__(self, job_id: str, device: int = 0, log_dir: str | None = None,
                 host: bool = False, daemon_args: tuple = ()):
        self.job_id, self.device, self.host = job_id, device, host
        self.daemon_args = list(daemon_args)
        self.dir = tempfile.mkdtemp(prefix=f"muond-{job_id}-")
        self.log_dir = log_dir or self.dir
        self.address = f"unix://{self.dir}/rank0.sock"
        self.procs = []

    def _start(self, name, cmd):
        log = open(os.path.join(self.log_dir, f"{self.job_id}-{name}.log"), "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def __enter__(self):
        port_file = os.path.join(self.dir, "port")
        self._start("coordinator", [_binary("server/coordinator/muond-coordinator"),
                                    "--listen=127.0.0.1:0", f"--port_file={port_file}"])
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            self._check(deadline)
        port = open(port_file).read().strip()
        self._start("muond", [_binary("server/daemon/muond-daemon"), f"--coordinator=127.0.0.1:{port}",
                              f"--job_id={self.job_id}", "--rank=0", "--world_size=1",
                              f"--listen={self.address}",
                              "--host" if self.host else f"--device={self.device}",
                              *self.daemon_args])
        return self

    def log(self) -> str:
        """The daemon's log so far."""
        with open(os.path.join(self.log_dir, f"{self.job_id}-muond.log")) as f:
            return f.read()

    def _check(self, deadline):
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; logs in "
                                   f"{self.log_dir}")
        if time.time() > deadline:
            raise RuntimeError("muond did not start in time")
        time.sleep(0.05)

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
