"""What `muond launch` (muond/launch/cli.py main) refuses with exit status 2
and one line before it starts anything: a missing command, an unusable log
dir or token file.
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
                 "not a writable directory"),
                (["--log-dir", tmp, "--token-file", "/dev/null"],
                 "--token-file /dev/null: not a regular file"),
                (["--log-dir", tmp, "--token-file", tmp], f"--token-file {tmp}: not a regular"),
                (["--log-dir", tmp, "--token-file", f"{tmp}/no"], "No such file")]:
            code, err = self.main(*base, *argv, "--", "true")
            self.assertEqual(code, 2, err)
            self.assertIn(phrase, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual(err.count("\n"), 1, err)


if __name__ == "__main__":
    unittest.main()
