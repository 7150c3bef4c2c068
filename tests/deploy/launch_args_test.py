"""deploy/local/launch.py refuses what a user plausibly gets wrong with one
clear line naming the option and the rule (exit 2 from --check-args, the
check run-demo.sh makes before building; exit 1 "launcher: FAILED: ..." at
launch), never a Python traceback, and before it starts any process:

* --job-id with a '/' (it names the socket directory and shm objects), a
  non-positive --health-timeout, too many --nproc, an unknown --parallel and a
  2-D layout whose --inner does not divide --nproc;
* what examples/char_gpt/train_dist.py would refuse on every rank after the
  build: unknown or malformed trainer options (after --), a TP size that does
  not divide --heads, a data-parallel size that does not divide --batch;
* an --out that cannot be created, a --bin without the servers;
* a second launch writing to the --out of a running one (both used to write
  the same logs/, report.md and params files, the later silently winning).

Without --bin the servers come from muond launch's lookup: the installed
wheel's first, then $MUOND_BIN, then the checkout's bazel-bin.
"""
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from muond import _servers

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(RUNFILES, "deploy/local/launch.py")


def launch(*args):
    return subprocess.run([sys.executable, LAUNCH, *args], capture_output=True, text=True,
                          timeout=60)


class LaunchArgsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="muond-launch-args-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.missing_bin = os.path.join(self.tmp, "no-bin")

    def assertRefused(self, proc, code, *phrases):
        text = proc.stdout + proc.stderr
        self.assertEqual(proc.returncode, code, text)
        self.assertNotIn("Traceback", text)
        for phrase in phrases:
            self.assertIn(phrase, text)

    def test_check_args_names_the_option(self):
        self.assertRefused(launch("--check-args", "--job-id", "team/a"), 2,
                           "--job-id", "'team/a'", "letters, digits")
        self.assertRefused(launch("--check-args", "--health-timeout", "0"), 2,
                           "--health-timeout", "must be > 0")
        self.assertEqual(launch("--check-args", "--job-id", "run-7.a_b").returncode, 0)
        self.assertRefused(launch("--check-args", "--nproc", "1000"), 2,
                           "--nproc", "1000 processes", "at most 64")
        self.assertEqual(launch("--check-args", "--nproc", "64").returncode, 0)

    def test_check_args_checks_trainer_options_with_device_auto(self):
        """--device auto (the default) knows its process count only at launch:
        the trainer's own options are checked before the build all the same."""
        self.assertRefused(launch("--check-args", "--", "--state-dtype", "fp8"), 2,
                           "--state-dtype", "invalid choice: 'fp8'", "fp8_e4m3")
        self.assertEqual(launch("--check-args", "--", "--state-dtype", "fp8_e4m3",
                                "--state-location", "host").returncode, 0)

    def test_check_args_parallel(self):
        """--parallel names a layout; a 2-D layout needs --nproc a multiple of
        --inner (on CPU the default --nproc is 4)."""
        self.assertRefused(launch("--check-args", "--parallel", "zero3"), 2,
                           "--parallel", "invalid choice: 'zero3'", "fsdp+tp")
        self.assertRefused(launch("--check-args", "--device", "cpu", "--nproc", "3",
                                  "--parallel", "fsdp+tp"), 2,
                           "--parallel fsdp+tp", "--nproc must be a multiple of 2")
        self.assertRefused(launch("--check-args", "--device", "cpu", "--parallel", "hsdp",
                                  "--inner", "3"), 2,
                           "--parallel hsdp", "(--inner 3)", "multiple of 3")
        self.assertRefused(launch("--check-args", "--inner", "0"), 2, "--inner", "must be >= 1")
        # (3 or 6 data-parallel ranks need a global --batch they divide.)
        for ok in (["--parallel", "ddp", "--nproc", "3", "--", "--batch", "30"],
                   ["--nproc", "3", "--", "--batch", "33"], ["--parallel", "tp", "--nproc", "3",
                                                             "--", "--heads", "3"],
                   ["--device", "cpu", "--parallel", "hsdp", "--nproc", "6", "--inner", "3",
                    "--", "--batch", "30"],
                   ["--device", "cpu"]):
            self.assertEqual(launch("--check-args", *ok).returncode, 0, ok)

    def test_check_args_applies_the_trainers_layout_rule(self):
        """What every train_dist.py rank would refuse after the build (its
        parser and check_layout, examples/char_gpt/options.py) is refused
        by --check-args, saying what to pass instead."""
        self.assertRefused(launch("--check-args", "--parallel", "tp", "--nproc", "3"), 2,
                           "--heads 4 is not divisible by the TP size 3",
                           "`-- --heads 6 --d-model 192`", "`--nproc 2` or `--nproc 4`")
        self.assertRefused(launch("--check-args", "--parallel", "ddp", "--nproc", "5"), 2,
                           "--batch 32 (the global batch) is not divisible by the 5",
                           "`-- --batch 30`", "`--nproc 4` or `--nproc 8`")
        self.assertRefused(launch("--check-args", "--nproc", "4", "--", "--bogus", "1"), 2,
                           "unknown trainer option(s) after --: --bogus 1")
        self.assertRefused(launch("--check-args", "--nproc", "4", "--", "--heads", "x"), 2,
                           "trainer options after --", "--heads", "'x'")
        # The fixes it names pass.
        for ok in (["--parallel", "tp", "--nproc", "3", "--", "--heads", "6", "--d-model", "192"],
                   ["--parallel", "ddp", "--nproc", "5", "--", "--batch", "30"],
                   ["--parallel", "tp", "--nproc", "2"]):
            self.assertEqual(launch("--check-args", *ok).returncode, 0, ok)

    def test_check_args_ns_options(self):
        """The demo's muond NS options (examples/char_gpt/options.py) reach the
        trainer's parser: Gram NS, its dtype, a comma list of restarts, the
        precision; malformed values are refused naming the option."""
        cpu = ("--check-args", "--device", "cpu", "--")
        self.assertEqual(launch(*cpu, "--ns-algorithm", "gram", "--gram-dtype", "bf16",
                                "--gram-restarts", "2,4", "--fp32-matmul-prec",
                                "medium").returncode, 0)
        self.assertRefused(launch(*cpu, "--gram-restarts", "2;4"), 2,
                           "--gram-restarts", "comma list of ints", "'2;4'")
        self.assertRefused(launch(*cpu, "--ns-algorithm", "grams"), 2,
                           "--ns-algorithm", "'grams'")
        self.assertRefused(launch(*cpu, "--fp32-matmul-prec", "low"), 2,
                           "--fp32-matmul-prec", "'low'")

    def test_unusable_out_and_bin_fail_before_starting_anything(self):
        blocker = os.path.join(self.tmp, "file")
        open(blocker, "w").close()
        self.assertRefused(launch("--out", os.path.join(blocker, "out"),
                                  "--bin", self.missing_bin), 1,
                           "launcher: FAILED: --out", "cannot create")
        out = os.path.join(self.tmp, "out")
        self.assertRefused(launch("--out", out, "--bin", self.missing_bin), 1,
                           f"launcher: FAILED: --bin {self.missing_bin}: no muond-coordinator")
        self.assertEqual(os.listdir(os.path.join(out, "logs")), [])

    def test_second_launch_on_the_same_out_is_refused(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        # This process plays the running launch.
        with open(os.path.join(out, ".launch.lock"), "a+") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.write(f"{os.getpid()}\n")
            held.flush()
            proc = launch("--out", out, "--bin", self.missing_bin)
        self.assertRefused(proc, 1, f"--out {out} is in use by another launch "
                                    f"(pid {os.getpid()})", "own --out")
        self.assertFalse(os.path.exists(os.path.join(out, "logs")))
        # Once the first ended, the same --out works again (here: up to --bin).
        self.assertRefused(launch("--out", out, "--bin", self.missing_bin), 1,
                           "--bin")


class DefaultBinTest(unittest.TestCase):
    def setUp(self):
        spec = importlib.util.spec_from_file_location("demo_launch", LAUNCH)
        self.demo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.demo)
        self.tmp = tempfile.mkdtemp(prefix="muond-launch-bin-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def executables(self, directory, *paths):
        for path in paths:
            path = os.path.join(directory, path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
            os.chmod(path, 0o755)
        return directory

    def test_installed_wheel_then_muond_bin_then_bazel_bin(self):
        flat = self.executables(os.path.join(self.tmp, "bundle-bin"),
                                "muond-daemon", "muond-coordinator")
        with mock.patch.dict(os.environ, {"MUOND_BIN": flat}):
            self.assertEqual(self.demo.default_bin(), flat)
            package = self.executables(
                os.path.join(self.tmp, "muond", "_bin"),
                *[p for name in _servers.SERVERS for p in (name, f"libexec/{name}")])
            with mock.patch.object(_servers, "BIN_DIR", package), \
                    mock.patch.object(_servers, "LIBEXEC_DIR", os.path.join(package, "libexec")):
                self.assertEqual(self.demo.default_bin(), package)
        with mock.patch.dict(os.environ, {"MUOND_BIN": ""}):
            self.assertEqual(self.demo.default_bin(), os.path.join(self.demo.ROOT, "bazel-bin"))


if __name__ == "__main__":
    unittest.main()
