"""bench/megatron_train_bench.py on CPU as a Megatron-LM user runs it: `muond
launch --device cpu --nproc-per-node 4 -- torchrun --nproc-per-node 4
megatron_train_bench.py` (real host-mode daemons, gloo trainers, TP 2 x DP
2). The trainers pass no connection keyword: each rank's
``muond.megatron.get_megatron_optimizer`` finds its daemon from the
launch's environment.

The independent reference is Megatron-Core's own Muon (TensorParallelMuon,
duplicated mode, fp32 NS), trained by the bench in the same processes from
the same init and batches: over these first steps the two loss curves agree
to fp32 rounding (the first loss exactly: nothing has stepped), the losses
fall, and the table names both optimizers and the noise-floor run (Megatron's
own from an init one rounding step off). No times are asserted.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

from tests.common.launched import bin_dir, launch_env

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(RUNFILES, "bench", "megatron_train_bench.py")
STEPS = 6
LOSS_TOL = 1e-3

try:
    sys.path.insert(0, os.path.join(RUNFILES, "tests", "megatron"))
    import megatron_cpu  # noqa: F401  (typing.override)
    import megatron.core  # noqa: F401
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False


@unittest.skipUnless(HAVE_MEGATRON, "megatron-core is not installed (deploy/setup.sh installs it)")
class MegatronTrainBenchTest(unittest.TestCase):
    def test_muond_trains_like_megatrons_muon_under_launch(self):
        out = tempfile.mkdtemp(prefix="megatron-bench-")
        argv = [sys.executable, "-m", "muond.cli", "launch", "--bin-dir", bin_dir(),
                "--nproc-per-node", "4", "--device", "cpu", "--log-dir",
                os.path.join(out, "logs"), "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", BENCH, "--steps", str(STEPS), "--out", out]
        proc = subprocess.run(argv, env=launch_env(), capture_output=True, text=True,
                              timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertIn("| muond.megatron |", proc.stdout)
        self.assertIn("(noise floor) |", proc.stdout)
        self.assertIn("TP 2 x DP 2", proc.stdout)
        with open(os.path.join(out, "curves.json")) as f:
            runs = json.load(f)["runs"]
        ref, got = runs["megatron"]["loss"], runs["muond"]["loss"]
        self.assertEqual(len(ref), STEPS)
        self.assertEqual(got[0], ref[0])
        for step, (a, b) in enumerate(zip(ref, got)):
            self.assertLessEqual(abs(a - b), LOSS_TOL, f"step {step}")
        self.assertLess(got[-1], got[0] - 0.5)  # the fortunes corpus is learnable
        self.assertEqual(len(runs["muond"]["step_ms"]), STEPS)


if __name__ == "__main__":
    unittest.main()
