"""bench/gpu_step_bench.py's per-kernel profiles without a GPU: short_kernel_name (its
torch.profiler tables) on the real kernel names of kernel_name_cases.txt, which
bench/gpu/kernel_name.h's C++ twin is tested on too, so both profilers' tables name a kernel
alike; and profile_inprocess against stand-in step_bench scripts: the table it keeps, and the
errors that say why there is none."""
import argparse
import importlib.util
import os
import stat
import sys
import tempfile
import types
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


def write_script(path, body):
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


class ProfileInprocessTest(unittest.TestCase):
    """A stand-in step_bench in a MUOND_BIN folder beside a lib/libkernel_profile.so (any
    file: the stand-in never loads it), found through daemon_harness._binary."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.bin = os.path.join(self.dir, "bin")
        os.makedirs(self.bin)
        os.makedirs(os.path.join(self.dir, "lib"))
        open(os.path.join(self.dir, "lib", "libkernel_profile.so"), "w").close()
        harness = types.ModuleType("daemon_harness")
        harness._binary = lambda rel: os.path.join(self.bin, os.path.basename(rel))
        self.saved = sys.modules.get("daemon_harness"), os.environ.get("MUOND_BIN")
        sys.modules["daemon_harness"] = harness
        os.environ["MUOND_BIN"] = self.bin
        self.path = os.path.join(self.dir, "out.md")
        self.o = argparse.Namespace(gram_restarts=None, gram_dtype="fp16", gram_min_aspect=None,
                                    sym_gemm_schedule="auto")

    def tearDown(self):
        module, muond_bin = self.saved
        if module is None:
            sys.modules.pop("daemon_harness", None)
        else:
            sys.modules["daemon_harness"] = module
        if muond_bin is None:
            os.environ.pop("MUOND_BIN", None)
        else:
            os.environ["MUOND_BIN"] = muond_bin

    def profile(self):
        bench.profile_inprocess(self.path, [(8, 8)], 3, 1, 0, False, "gram", self.o)

    def test_keeps_the_table_and_says_over_how_many_steps(self):
        write_script(os.path.join(self.bin, "step_bench"),
                     'case "$CUDA_INJECTION64_PATH" in *lib/libkernel_profile.so) ;; '
                     '*) exit 7 ;; esac\n'
                     'printf "| kernel | launches |\\n" > "$MUOND_KERNEL_PROFILE"\n'
                     'echo "step_ms_median 1.0 step_ms_min 1.0 matrices 1"\n')
        self.profile()
        with open(self.path) as f:
            lines = f.read().splitlines()
        self.assertEqual(lines[0], "step_bench --engine: totals over its 3 timed steps")
        self.assertEqual(lines[1], "| kernel | launches |")

    def test_no_table_names_what_the_library_said(self):
        write_script(os.path.join(self.bin, "step_bench"),
                     'echo "kernel_profile: cuptiActivityEnable failed: no device" >&2\n'
                     'echo "step_ms_median 1.0 step_ms_min 1.0 matrices 1"\n')
        with self.assertRaises(RuntimeError) as caught:
            self.profile()
        self.assertIn("no kernel profile written", str(caught.exception))
        self.assertIn("cuptiActivityEnable failed: no device", str(caught.exception))

    def test_a_failed_step_bench_shows_its_stderr(self):
        write_script(os.path.join(self.bin, "step_bench"),
                     'echo "RESOURCE_EXHAUSTED: the reason" >&2\nexit 3\n')
        with self.assertRaises(RuntimeError) as caught:
            self.profile()
        self.assertIn("step_bench exit 3", str(caught.exception))
        self.assertIn("RESOURCE_EXHAUSTED: the reason", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
