"""deploy/systemd/ checked by systemd's own tools (systemd-analyze 252).

* `systemd-analyze verify --root=R` on muond-coordinator.service and
  muond@<gpu>.service, installed in a temporary root R with stand-in
  /opt/muond/bin/muond-{daemon,coordinator} executables (the bundle) and the host's unit
  directory (for sysinit.target and friends): exit 0 and not one diagnostic
  (an unknown or malformed directive is only a warning with exit 0, so any
  output fails the test).
* The same check fails on a unit with a misspelled directive and on one whose
  ExecStart binary is missing: the check can fail.
* `systemd-analyze security --offline=yes --threshold=N`: the overall exposure
  stays under the threshold (coordinator 2.0, daemon 2.5 of 10).
* What the tool does not judge: the hardening a unit must have and what the
  daemon must not have (a private /dev or IPC namespace, RemoveIPC=: the
  trainers' POSIX shm must stay shared), the user of the sysusers.d snippet,
  and that every ${VAR} of an ExecStart is set in muond.env.example.
"""
import os
import re
import shutil
import subprocess
import tempfile
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
UNITS = os.path.join(RUNFILES, "deploy/systemd")
COORDINATOR = "muond-coordinator.service"
DAEMON = "muond@.service"
HOST_UNITS = "/usr/lib/systemd/system"
# Exposure thresholds, in systemd-analyze's 0..100 scale (10 = 1.0).
THRESHOLDS = {COORDINATOR: 20, "muond@0.service": 25}


def read_text(name):
    with open(os.path.join(UNITS, name)) as f:
        return f.read()


def read_unit(name):
    """Returns {(section, key): [values]} of a unit file."""
    out, section = {}, None
    with open(os.path.join(UNITS, name)) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            out.setdefault((section, key), []).append(value)
    return out


class SystemdUnitsTest(unittest.TestCase):
    def setUp(self):
        if not shutil.which("systemd-analyze") or not os.path.isdir(HOST_UNITS):
            self.fail("systemd-analyze and /usr/lib/systemd/system are needed "
                      "(deploy/setup.sh installs systemd)")
        self.root = tempfile.mkdtemp(prefix="muond-systemd-")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        shutil.copytree(HOST_UNITS, os.path.join(self.root, "usr/lib/systemd/system"),
                        symlinks=True)
        os.makedirs(os.path.join(self.root, "etc/systemd/system"))
        os.makedirs(os.path.join(self.root, "opt/muond/bin"))
        for binary in ("muond-daemon", "muond-coordinator"):
            path = os.path.join(self.root, "opt/muond/bin", binary)
            with open(path, "w") as f:
                f.write("#!/bin/sh\nexit 0\n")
            os.chmod(path, 0o755)
        for name in (COORDINATOR, DAEMON):
            self.install(name, read_text(name))

    def install(self, name, text):
        with open(os.path.join(self.root, "etc/systemd/system", name), "w") as f:
            f.write(text)

    def analyze(self, *args):
        return subprocess.run(["systemd-analyze", *args, f"--root={self.root}"],
                              capture_output=True, text=True, timeout=120)

    def verify(self, *units):
        return self.analyze("verify", "--man=no", *units)

    def assertClean(self, proc):
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual((proc.stdout + proc.stderr).strip(), "",
                         "systemd-analyze verify printed diagnostics")

    def test_verify_clean(self):
        self.assertClean(self.verify(COORDINATOR, "muond@0.service", "muond@7.service"))

    def test_verify_catches_a_misspelled_directive(self):
        text = read_text(DAEMON)
        self.assertIn("NoNewPrivileges=yes", text)
        self.install(DAEMON, text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
        proc = self.verify("muond@0.service")
        self.assertIn("Unknown key 'NoNewPrivilege'", proc.stdout + proc.stderr)

    def test_verify_catches_a_missing_binary(self):
        os.unlink(os.path.join(self.root, "opt/muond/bin/muond-coordinator"))
        proc = self.verify(COORDINATOR)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("/opt/muond/bin/muond-coordinator", proc.stdout + proc.stderr)

    def test_security_exposure_under_threshold(self):
        for unit, threshold in THRESHOLDS.items():
            proc = self.analyze("security", "--offline=yes", f"--threshold={threshold}",
                                "--no-pager", unit)
            text = proc.stdout + proc.stderr
            level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
            self.assertIsNotNone(level, text)
            self.assertLessEqual(float(level.group(1)) * 10, threshold, text)
            self.assertEqual(proc.returncode, 0, text)

    def test_hardening_directives(self):
        required = {
            "User": "muond", "Group": "muond", "NoNewPrivileges": "yes",
            "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
            "CapabilityBoundingSet": "", "SystemCallArchitectures": "native",
            "Restart": "on-failure", "EnvironmentFile": "/etc/muond/muond.env",
        }
        for name in (COORDINATOR, DAEMON):
            unit = read_unit(name)
            for key, value in required.items():
                self.assertEqual(unit.get(("Service", key)), [value], f"{name}: {key}=")
            families = unit[("Service", "RestrictAddressFamilies")][0].split()
            self.assertTrue({"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families), name)
        daemon = read_unit(DAEMON)
        self.assertEqual(daemon[("Service", "RuntimeDirectory")], ["muond"])
        self.assertEqual(daemon[("Service", "RuntimeDirectoryMode")], ["0700"])
        self.assertEqual(daemon[("Service", "DevicePolicy")], ["closed"])
        self.assertTrue(any("nvidia" in v for v in daemon[("Service", "DeviceAllow")]))
        exec_start = daemon[("Service", "ExecStart")][0]
        self.assertIn("--device=%i", exec_start)
        self.assertIn("--listen=unix:///run/muond/", exec_start)
        # Gloo carries the commit vote in GPU mode too: reachable across hosts.
        self.assertIn("--gloo_hostname=${MUOND_GLOO_HOSTNAME}", exec_start)
        for name in (COORDINATOR, DAEMON):  # the bundle's install location
            self.assertTrue(read_unit(name)[("Service", "ExecStart")][0].startswith(
                "/opt/muond/bin/muond-"), name)
        # The trainers' POSIX shm (/dev/shm) and IPC namespace stay shared.
        for key in ("PrivateDevices", "PrivateIPC", "RemoveIPC", "DynamicUser"):
            self.assertNotIn(("Service", key), daemon, f"{DAEMON} must not set {key}=")

    def test_sysusers_user_and_env_file(self):
        with open(os.path.join(UNITS, "muond.sysusers.conf")) as f:
            entries = [line.split() for line in f if line.strip() and not line.startswith("#")]
        self.assertIn(["u", "muond"], [e[:2] for e in entries])
        env = {}
        with open(os.path.join(UNITS, "muond.env.example")) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    key, _, value = line.strip().partition("=")
                    env[key] = value
        for name in (COORDINATOR, DAEMON):
            exec_start = read_unit(name)[("Service", "ExecStart")][0]
            for gpu in range(8):
                line = exec_start.replace("%i", str(gpu))
                for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", line):
                    self.assertIn(var, env, f"{name} (GPU {gpu}) reads ${var}")


if __name__ == "__main__":
    unittest.main()
