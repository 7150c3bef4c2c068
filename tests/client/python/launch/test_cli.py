"""What `muond launch` (muond/launch/cli.py main) refuses with exit status 2
and one line before it starts anything: a missing command, an empty job id,
an unusable log dir (or one whose parent is missing) or token file; and the
duration options argparse refuses (inf, nan, <= 0).
"""
import contextlib
import io
import os
import shutil
import tempfile
import unittest

from muond import cli
from muond.launch import main


class CheckBeforeStartTest(unittest.TestCase):
    """What main() refuses (exit 2, one line) before it starts anything."""

    def main(self, *argv, env=None):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(cli.build_parser().parse_args(["launch", *argv]))
        return code, err.getvalue()

    def test_missing_command_refused_first(self):
        # --bin-dir names nothing: the command is still what is reported.
        for argv, phrase in [([], "no command: the command goes after --"),
                             (["--"], "no command after --"),
                             (["true"], "'true' without --: the command goes after --")]:
            code, err = self.main("--bin-dir", "/nonexistent", *argv)
            self.assertEqual(code, 2, err)
            self.assertIn(phrase, err)
            self.assertIn("muond launch [options] -- COMMAND ...", err)
            self.assertEqual(err.count("\n"), 1, err)

    def test_paths(self):
        tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, tmp)
        bins = os.path.join(tmp, "bin")
        os.mkdir(bins)
        for name in ("muond-daemon", "muond-coordinator"):
            with open(os.path.join(bins, name), "w") as f:
                f.write("#!/bin/sh\nexit 9\n")
            os.chmod(os.path.join(bins, name), 0o755)
        base = ["--bin-dir", bins, "--device", "cpu"]
        for argv, phrase in [
                (["--log-dir", "/proc/1"], "--log-dir /proc/1: not a writable directory"),
                (["--log-dir", os.path.join(bins, "muond-daemon", "x")],
                 f"its parent {bins}/muond-daemon is not a directory"),
                (["--log-dir", tmp, "--token-file", "/dev/null"],
                 "--token-file /dev/null: not a regular file"),
                (["--log-dir", tmp, "--token-file", tmp], f"--token-file {tmp}: not a regular"),
                (["--log-dir", tmp, "--token-file", f"{tmp}/no"], "No such file")]:
            code, err = self.main(*base, *argv, "--", "true")
            self.assertEqual(code, 2, err)
            self.assertIn(phrase, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual(err.count("\n"), 1, err)


    def test_empty_job_id_is_refused_by_the_job_id_rule(self):
        code, err = self.main("--bin-dir", "/nonexistent", "--device", "cpu", "--job-id", "",
                              "--", "true")
        self.assertEqual(code, 2, err)
        self.assertIn("--job-id '' must be 1-64 letters, digits", err)
        self.assertEqual(err.count("\n"), 1, err)

    def test_log_dir_with_a_missing_parent_is_refused_and_not_created(self):
        tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, tmp)
        for name in ("muond-daemon", "muond-coordinator"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("#!/bin/sh\nexit 9\n")
            os.chmod(os.path.join(tmp, name), 0o755)
        missing = os.path.join(tmp, "typo", "logs")
        code, err = self.main("--bin-dir", tmp, "--device", "cpu", "--log-dir", missing,
                              "--", "true")
        self.assertEqual(code, 2, err)
        self.assertIn(f"--log-dir {missing}: its parent {tmp}/typo is not a directory", err)
        self.assertFalse(os.path.exists(os.path.join(tmp, "typo")))


class DurationOptionsTest(unittest.TestCase):
    """--stop-grace and --health-timeout: finite seconds > 0 (argparse, exit 2
    naming the option)."""

    def test_non_finite_and_non_positive_are_refused(self):
        for option in ("--stop-grace", "--health-timeout"):
            for value in ("inf", "nan", "-1", "0", "1e400", "Infinity"):
                with self.subTest(option=option, value=value):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as ex:
                        cli.build_parser().parse_args(["launch", option, value, "--", "true"])
                    self.assertEqual(ex.exception.code, 2)
                    self.assertIn(f"argument {option}", err.getvalue())
                    self.assertIn("must be > 0 and finite (seconds)", err.getvalue())
        args = cli.build_parser().parse_args(["launch", "--stop-grace", "2.5", "--", "true"])
        self.assertEqual(args.stop_grace, 2.5)

if __name__ == "__main__":
    unittest.main()
