"""What local mode's tests share: running local_trainer.py as a plain
process (no launcher, torchrun or Slurm variable; the servers found through
$MUOND_BIN_DIR) and reading what it wrote."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from muond.torch.discovery import JOB_VARIABLES
from tests.common.launched import bin_dir, launch_env

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "local_trainer.py")
# contract/common.py's REL_TOL: muond's fp32 NS against torch's, 3 steps.
REL_TOL = 2e-5


def plain_env(**extra) -> dict:
    env = dict(launch_env(HERE), MUOND_BIN_DIR=bin_dir())
    for key in (*JOB_VARIABLES, "MUOND_LOCAL"):
        env.pop(key, None)
    env.update(extra)
    return env


def output_dir(test) -> str:
    """A fresh directory for the trainer's info.json, removed after `test`."""
    out = tempfile.mkdtemp(prefix="muond-local-test-")
    test.addCleanup(shutil.rmtree, out, ignore_errors=True)
    return out


def run_trainer(test, mode: str, timeout: float = 120, **extra) -> dict:
    """Runs local_trainer.py MODE to its end; its info.json (the test fails
    with the trainer's output when it did not end cleanly)."""
    out = output_dir(test)
    proc = subprocess.run([sys.executable, TRAINER, mode, out], env=plain_env(**extra),
                          capture_output=True, text=True, timeout=timeout)
    test.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    return read_info(out)


def read_info(out: str) -> dict:
    with open(os.path.join(out, "info.json")) as f:
        return json.load(f)


def wait_until(predicate, timeout: float):
    """predicate() once true, else its last value after `timeout` s (a
    liveness bound only)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
