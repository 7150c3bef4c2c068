"""The servers' kMuondVersion (server/common/version.h, what muond_build_info
reports) equals the Python package's version (muond/_version.py, its one
home): a release bumps both. `muond-daemon --version` and
`muond-coordinator --version` print "<binary> <that version>"."""
import os
import re
import subprocess
import unittest

import muond

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class VersionTest(unittest.TestCase):
    def test_server_version_is_the_package_version(self):
        with open(os.path.join(RUNFILES, "server", "common", "version.h")) as f:
            found = re.findall(r'kMuondVersion\[\] = "([^"]*)";', f.read())
        self.assertEqual(len(found), 1, "kMuondVersion not found in server/common/version.h")
        self.assertRegex(found[0], r"^\d+\.\d+\.\d+")
        self.assertEqual(found[0], muond.__version__)

    def test_servers_print_name_and_version(self):
        for rel in ("server/daemon/muond-daemon", "server/coordinator/muond-coordinator"):
            proc = subprocess.run([os.path.join(RUNFILES, rel), "--version"],
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual((proc.returncode, proc.stdout),
                             (0, f"{os.path.basename(rel)} {muond.__version__}\n"), proc.stderr)


if __name__ == "__main__":
    unittest.main()
