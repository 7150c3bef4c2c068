"""Where `muond launch` finds the servers (muond/launch/discovery.py)
without --bin-dir or $MUOND_BIN_DIR: on PATH each by its own name, else the
bazel-bin of the checkout around the current directory.
"""
import os
import re
import shutil
import tempfile
import unittest

from muond.launch.discovery import find_servers
from muond.launch.errors import LaunchError


class FindServersTest(unittest.TestCase):
    """Without --bin-dir/$MUOND_BIN_DIR/PATH: the bazel-bin of the checkout
    around the current directory (WORKSPACE upwards), wherever the package is
    installed."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp)
        self.addCleanup(os.chdir, os.getcwd())
        self.repo = os.path.join(self.tmp, "repo")
        os.makedirs(os.path.join(self.repo, "a", "b"))
        open(os.path.join(self.repo, "WORKSPACE"), "w").close()

    def test_checkout_bazel_bin_from_a_subdirectory(self):
        os.chdir(os.path.join(self.repo, "a", "b"))
        with self.assertRaisesRegex(LaunchError, re.escape(
                f"pass --bin-dir {self.repo}/bazel-bin")):
            find_servers(None, {"PATH": ""})
        want = []
        for rel in ("server/daemon/muond-daemon", "server/coordinator/muond-coordinator"):
            path = os.path.join(self.repo, "bazel-bin", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
            os.chmod(path, 0o755)
            want.append(path)
        self.assertEqual(find_servers(None, {"PATH": ""}),
                         (want[0], want[1], os.path.join(self.repo, "bazel-bin")))

    def test_path_lookup_by_name(self):
        """muond-daemon and muond-coordinator on PATH, each where it is (the
        `muond` CLI on PATH is not the daemon); one without the other is refused."""
        os.chdir(self.tmp)
        dirs = [os.path.join(self.tmp, d) for d in ("cli", "d", "c")]
        for d, name in zip(dirs, ("muond", "muond-daemon", "muond-coordinator")):
            os.mkdir(d)
            open(os.path.join(d, name), "w").close()
            os.chmod(os.path.join(d, name), 0o755)
        self.assertEqual(find_servers(None, {"PATH": os.pathsep.join(dirs)}),
                         (os.path.join(dirs[1], "muond-daemon"),
                          os.path.join(dirs[2], "muond-coordinator"), "PATH"))
        with self.assertRaisesRegex(LaunchError, "no executable muond-daemon; pass --bin-dir"):
            find_servers(None, {"PATH": os.pathsep.join([dirs[0], dirs[2]])})

    def test_outside_a_checkout(self):
        os.chdir(self.tmp)
        with self.assertRaises(LaunchError) as cm:
            find_servers(None, {"PATH": ""})
        self.assertIn("--bin-dir (a bundle's bin/ or a bazel-bin tree)", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
