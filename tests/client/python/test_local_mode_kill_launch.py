"""Local mode's whole-process cases (real servers): a trainer SIGKILLed
after its first step leaves no server process and no directory (its reaper,
the launcher's, stops them, and says so as the local cluster); `muond launch
--nproc-per-node 1 -- python train.py` without $RANK steps on the launcher's
daemon (rank 0) like torch.optim.Muon and starts no local cluster."""
import os
import signal
import subprocess
import sys
import unittest

from local_mode_runs import REL_TOL, TRAINER, output_dir, plain_env, read_info, wait_until
from muond.launch.processes import is_alive
from tests.common.launched import bin_dir

# Liveness bounds only: the reaper gives the servers muond.local's 10 s stop
# grace before SIGKILL.
START_BOUND_S = 60
CLEAN_BOUND_S = 40


class LocalModeKillAndLaunchTest(unittest.TestCase):
    def test_sigkilled_trainer_leaves_no_server_and_no_directory(self):
        out = output_dir(self)
        # The reaper inherits the trainer's stderr and says there what it did.
        stderr = open(os.path.join(out, "stderr"), "w+")
        self.addCleanup(stderr.close)
        proc = subprocess.Popen([sys.executable, TRAINER, "kill", out], env=plain_env(),
                                stderr=stderr)
        self.addCleanup(proc.wait)
        self.addCleanup(proc.kill)
        info_file = os.path.join(out, "info.json")
        self.assertTrue(wait_until(lambda: os.path.exists(info_file) or proc.poll() is not None,
                                   START_BOUND_S) and os.path.exists(info_file),
                        "the trainer did not step")
        info = read_info(out)
        self.assertEqual(len(info["pids"]), 3)
        self.assertTrue(all(is_alive(p) for p in info["pids"]))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone = wait_until(lambda: not any(map(is_alive, info["pids"]))
                          and not os.path.exists(info["directory"]), CLEAN_BOUND_S)
        self.assertTrue(gone, f"left: {[p for p in info['pids'] if is_alive(p)]}, "
                              f"directory {os.path.exists(info['directory'])}")
        # Its line names the local cluster, not `muond launch`, which the
        # user never ran.
        said = f"muond local cluster: the trainer (pid {proc.pid}) died: stopped its servers"

        def output():
            with open(stderr.name) as f:
                return f.read()

        self.assertTrue(wait_until(lambda: said in output(), CLEAN_BOUND_S), output())
        self.assertNotIn("muond launch", output())

    def test_one_rank_launch_without_rank_steps_on_the_launchers_daemon(self):
        out = output_dir(self)
        cmd = [sys.executable, "-m", "muond.cli", "launch", "--bin-dir", bin_dir(),
               "--nproc-per-node", "1", "--device", "cpu", "--",
               sys.executable, TRAINER, "launched", out]
        done = subprocess.run(cmd, env=plain_env(), capture_output=True, text=True, timeout=180,
                              cwd=out)  # the launcher's logs go there
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        info = read_info(out)
        self.assertEqual(info["pids"], [])  # no local cluster: the launcher's daemon
        self.assertLess(info["rel_diff"], REL_TOL)


if __name__ == "__main__":
    unittest.main()
