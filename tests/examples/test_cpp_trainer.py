"""examples/cpp_trainer against a real host daemon (a coordinator and one
`muond-daemon --host`, contract/cluster.py): the C++ trainer fits its
matrices (the loss falls by more than half in 30 steps), its steps go
through the step channel, and the same run over the Step RPC prints the same
losses, digit for digit."""
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python", "contract"))
from cluster import ClusterTestCase  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))


def trainer_binary() -> str:
    for path in (os.path.join(REPO, "examples/cpp_trainer/trainer"),  # bazel test's runfiles
                 os.path.join(REPO, "bazel-bin/examples/cpp_trainer/trainer")):
        if os.access(path, os.X_OK):
            return path
    raise unittest.SkipTest("bazel build //examples/cpp_trainer:trainer first")


class CppTrainerTest(ClusterTestCase):
    def run_trainer(self, step_channel: bool) -> str:
        run = subprocess.run(
            [trainer_binary(), f"--address={self.cluster.daemons[0]}",
             f"--job_id={self.cluster.job_id}", "--steps=30",
             f"--step_channel={'true' if step_channel else 'false'}"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        return run.stdout

    def test_the_trainer_fits_through_the_channel_as_over_grpc(self):
        channel = self.run_trainer(step_channel=True)
        self.assertIn("step channel: yes", channel)
        losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", channel)]
        self.assertEqual(len(losses), 5)  # steps 1, 10, 20, 30, final
        self.assertLess(losses[-1], 0.5 * losses[0])
        rpc = self.run_trainer(step_channel=False)
        self.assertRegex(rpc, r"step channel: FAILED_PRECONDITION: .*step_channel is false")
        self.assertEqual(re.findall(r"loss [0-9.]+", rpc), re.findall(r"loss [0-9.]+", channel))


if __name__ == "__main__":
    unittest.main()
