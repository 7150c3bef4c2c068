"""bench/gpu_step_bench.py's --gpu-clocks without a GPU: GpuClocks against a stand-in
nvidia-smi on PATH (its samples parsed, the idle ones left out of the medians, unreadable
lines skipped, the sampler stopped at the block's end), no samples without nvidia-smi, and
the set's table of medians."""
import importlib.util
import os
import stat
import tempfile
import time
import types
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "gpu_step_bench", os.path.join(ROOT, "bench", "gpu_step_bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

# One GPU: idle, then busy at two clocks, a line nvidia-smi prints for a missing reading,
# then it samples on (sleeps) until the bench stops it; its arguments go to args.txt.
FAKE_SMI = """#!/bin/sh
echo "$@" > "$(dirname "$0")/args.txt"
echo "0, 345, 70.00"
echo "100, 1575, 699.50"
echo "97, 1410, 701.25"
echo "[N/A], 1980, 300.00"
echo "99, 1650, 690.00"
exec sleep 30
"""


class GpuClocksTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        path = os.path.join(self.dir, "nvidia-smi")
        with open(path, "w") as f:
            f.write(FAKE_SMI)
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        self.saved_path = os.environ["PATH"]
        os.environ["PATH"] = self.dir + os.pathsep + self.saved_path

    def tearDown(self):
        os.environ["PATH"] = self.saved_path

    def test_medians_of_the_busy_samples_and_the_sampler_stopped(self):
        with bench.GpuClocks(True, "00000000:19:00.0") as clocks:
            time.sleep(0.5)  # the stand-in prints its lines and sleeps on
        self.assertIsNotNone(clocks.proc.poll(), "nvidia-smi left running")
        self.assertEqual(len(clocks.samples), 4)  # the [N/A] line skipped
        self.assertEqual(clocks.medians(), (1575.0, 699.5, 3))  # the idle one left out
        with open(os.path.join(self.dir, "args.txt")) as f:
            args = f.read().split()
        self.assertIn("--query-gpu=utilization.gpu,clocks.sm,power.draw", args)
        self.assertEqual(args[args.index("-i") + 1], "00000000:19:00.0")

    def test_off_or_without_nvidia_smi_no_samples(self):
        with bench.GpuClocks(False) as off:
            pass
        self.assertIsNone(off.proc)
        self.assertIsNone(off.medians())
        os.environ["PATH"] = tempfile.mkdtemp()  # no nvidia-smi
        with bench.GpuClocks(True) as missing:
            pass
        self.assertIsNone(missing.medians())

    def test_set_table_lists_each_round_and_column(self):
        a = types.SimpleNamespace(syrk=False, gpu_clocks=True)
        o = types.SimpleNamespace(gram_restarts=[3], muond_default_restarts=[3],
                                  gram_min_aspect=None)
        rows = [{"inproc_gram": 24.0, "inproc_gram_clocks": (1575.0, 699.5, 3)},
                {"inproc_gram": 24.1, "inproc_gram_clocks": None}]
        table = bench.set_table("qwen3_30b_a3b", 1, 0, [(768, 2048)], ["inproc_gram"],
                                rows, {}, a, o)
        self.assertIn("| 1 | muond in-process gram | 1575 | 700 | 3 |", table)
        self.assertNotIn("| 2 | muond in-process gram |", table.split("median SM MHz")[1])


if __name__ == "__main__":
    unittest.main()
