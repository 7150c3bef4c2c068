"""Every shell script of deploy/ (deploy/*.sh, deploy/slurm/*) and CI's
.ci/run passes shellcheck (0.9.0, default severity: style notes too), and
so does the script the sbatch file hands to `srun bash -c '...'` (shellcheck
does not look inside a quoted string). A script with a defect fails: the
check can fail.
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SBATCH = os.path.join(RUNFILES, "deploy/slurm/muond.sbatch")


def shellcheck(*paths):
    return subprocess.run(["shellcheck", "--external-sources", *paths],
                          capture_output=True, text=True, timeout=120)


def scripts():
    found = sorted(glob.glob(os.path.join(RUNFILES, "deploy/*.sh")))
    found += sorted(p for p in glob.glob(os.path.join(RUNFILES, "deploy/slurm/*"))
                    if os.path.basename(p) != "BUILD")
    return found + [os.path.join(RUNFILES, ".ci/run")]


class ShellcheckTest(unittest.TestCase):
    def setUp(self):
        self.assertIsNotNone(shutil.which("shellcheck"),
                             "shellcheck is needed (deploy/setup.sh installs it)")
        self.tmp = tempfile.mkdtemp(prefix="muond-shellcheck-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def test_scripts_pass(self):
        found = scripts()
        names = {os.path.relpath(p, RUNFILES) for p in found}
        self.assertTrue({"deploy/setup.sh", "deploy/test.sh", "deploy/bundle.sh",
                         "deploy/slurm/muond.sbatch", ".ci/run"} <= names, names)
        for path in found:
            with open(path) as f:
                self.assertRegex(f.readline(), r"^#!.*\b(ba)?sh\b", path)
        proc = shellcheck(*found)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_srun_command_passes(self):
        with open(SBATCH) as f:
            text = f.read()
        scripts_in = re.findall(r"bash -c '\n(.*?)\n' ", text, re.S)
        self.assertEqual(len(scripts_in), 1, "one srun bash -c '...' script")
        path = os.path.join(self.tmp, "srun-command.sh")
        with open(path, "w") as f:
            f.write("#!/usr/bin/env bash\n" + scripts_in[0] + "\n")
        proc = shellcheck(path)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_a_defect_fails(self):
        path = os.path.join(self.tmp, "bad.sh")
        with open(path, "w") as f:
            f.write('#!/usr/bin/env bash\ncd "$(dirname "$0")"\nrm -rf $1/out\n')
        proc = shellcheck(path)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("SC2086", proc.stdout)


if __name__ == "__main__":
    unittest.main()
