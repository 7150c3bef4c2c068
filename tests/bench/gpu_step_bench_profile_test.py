"""bench/gpu_step_bench.py's short_kernel_name (its per-kernel tables from torch.profiler) on
the real kernel names of kernel_name_cases.txt, which bench/gpu/kernel_name.h's C++ twin is
tested on too, so both profilers' tables name a kernel alike."""
import importlib.util
import os
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "gpu_step_bench", os.path.join(ROOT, "bench", "gpu_step_bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def cases():
    with open(os.path.join(ROOT, "tests", "bench", "kernel_name_cases.txt")) as f:
        lines = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]
    return list(zip(lines[0::2], lines[1::2]))


class ShortKernelNameTest(unittest.TestCase):
    def test_real_names_as_the_cases_file_says(self):
        got = cases()
        self.assertEqual(len(got), 7, "kernel_name_cases.txt not read whole")
        for name, want in got:
            self.assertEqual(bench.short_kernel_name(name), want, name)

    def test_caps_at_160_characters(self):
        self.assertEqual(bench.short_kernel_name("k" * 300), "k" * 160)


if __name__ == "__main__":
    unittest.main()
