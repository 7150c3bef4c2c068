"""bench/scaling (scaling_bench) on the CPU equivalent of the multi-GPU run:
host ranks over Gloo, one process each. The bench runs the
layer-sharded step engine and the duplicated path from the same params and
grads and exits 1 when they differ at highest precision, so these runs check
the step engine's routing against the all-gather path at 1, 2 and 4 ranks
(and at medium, bf16 exchanges), besides the bench's own plumbing."""
import os
import re
import subprocess
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(RUNFILES, "bench", "scaling", "scaling_bench")
SHAPES = "64x48*3,128x64*2,32x128*3,8x8"


def run(*args):
    return subprocess.run([BENCH, "--device=cpu", *args], capture_output=True,
                          text=True, timeout=240)


class ScalingBenchTest(unittest.TestCase):
    def check(self, precision):
        p = run(f"--shapes={SHAPES}", "--ranks=1,2,4", f"--precision={precision}",
                "--steps=2", "--warmup=1")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        diffs = re.findall(r"(\d) ranks: sharded vs duplicated params max \|diff\| (\S+)",
                           p.stdout)
        self.assertEqual([(n, float(d.rstrip(";"))) for n, d in diffs],
                         [("1", 0.0), ("2", 0.0), ("4", 0.0)], p.stdout)
        rows = [l for l in p.stdout.splitlines() if re.match(r"\| \d \| (sharded|duplicated) \|", l)]
        self.assertEqual(len(rows), 6, p.stdout)
        self.assertRegex(p.stdout, r"4 ranks: .*forward exchange \S+ GB/s vs raw all_to_allv")
        self.assertRegex(p.stdout, r"NS time \(slowest rank\), 4 vs 1 ranks: sharded \S+x")

    def test_sharded_equals_duplicated_highest(self):
        self.check("highest")

    def test_sharded_equals_duplicated_medium(self):
        self.check("medium")

    def test_bad_arguments_name_the_flag(self):
        for args, needle in [(["--shapes=63x48", "--ranks=2"], "not divisible by 2"),
                             (["--shapes=64x48", "--ranks=0"], "--ranks"),
                             (["--shapes=64xx", "--ranks=1"], "--shapes: bad entry"),
                             (["--shapes=64x48", "--ranks=1", "--device=tpu"], "--device")]:
            p = subprocess.run([BENCH, *args], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(needle, p.stderr, args)


if __name__ == "__main__":
    unittest.main()
