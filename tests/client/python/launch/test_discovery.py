"""Where `muond launch` finds the servers (muond/launch/discovery.py):
--bin-dir, the installed package's (muond/_bin of a platform wheel),
$MUOND_BIN_DIR, on PATH each by its own name (past the package's console
scripts), else the bazel-bin of the checkout around the current directory.
"""
import os
import re
import shutil
import tempfile
import unittest
from unittest import mock

from muond import _servers
from muond.launch.discovery import find_muonctl, find_servers, servers_dir
from muond.launch.errors import LaunchError


def executable(path: str, text: str = "") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


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
        self.assertIn(f"no checkout around {os.getcwd()}", str(cm.exception))

    def test_a_training_scripts_cluster_is_told_of_muond_bin_dir(self):
        # A plain script's local cluster (muond.local) has no --bin-dir to pass.
        for where, root in (("outside", self.tmp), ("inside", self.repo)):
            os.chdir(root)
            with self.subTest(where), self.assertRaises(LaunchError) as cm:
                find_servers(None, {"PATH": ""}, has_bin_dir_flag=False)
            message = str(cm.exception)
            self.assertIn("set $MUOND_BIN_DIR to a bazel-bin tree or a bundle's bin/", message)
            self.assertNotIn("--bin-dir", message)
            self.assertIn("$MUOND_BIN_DIR (unset)", message)


class LookupOrderTest(unittest.TestCase):
    """The installed package's servers after --bin-dir and before
    $MUOND_BIN_DIR, PATH and bazel-bin; its console scripts on PATH never
    stand in for servers."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp)
        self.addCleanup(os.chdir, os.getcwd())
        open(os.path.join(self.tmp, "WORKSPACE"), "w").close()
        os.chdir(self.tmp)
        self.tree = {name: executable(os.path.join(self.tmp, "bazel-bin", rel))
                     for name, rel in (("muond-daemon", "server/daemon/muond-daemon"),
                                       ("muond-coordinator",
                                        "server/coordinator/muond-coordinator"))}
        self.flat = os.path.join(self.tmp, "flat")
        for name in _servers.SERVERS:
            executable(os.path.join(self.flat, name))

    def package(self) -> str:
        """A muond/_bin as deploy/wheel.sh lays it out, patched in as the
        installed package's."""
        bin_dir = os.path.join(self.tmp, "site", "muond", "_bin")
        for name in _servers.SERVERS:
            executable(os.path.join(bin_dir, name), "#!/usr/bin/env python3\n")
            executable(os.path.join(bin_dir, "libexec", name))
        for attr, value in (("BIN_DIR", bin_dir),
                            ("LIBEXEC_DIR", os.path.join(bin_dir, "libexec"))):
            patcher = mock.patch.object(_servers, attr, value)
            patcher.start()
            self.addCleanup(patcher.stop)
        return bin_dir

    def test_package_wins_over_env_path_and_bazel_bin_not_over_bin_dir(self):
        env = {"PATH": self.flat, "MUOND_BIN_DIR": self.flat}
        self.assertEqual(find_servers(None, env)[2], f"$MUOND_BIN_DIR {self.flat}")
        bin_dir = self.package()
        self.assertEqual(find_servers(None, env),
                         (os.path.join(bin_dir, "muond-daemon"),
                          os.path.join(bin_dir, "muond-coordinator"),
                          f"the installed muond package {bin_dir}"))
        self.assertEqual(find_muonctl(find_servers(None, env)[1]),
                         os.path.join(bin_dir, "muonctl"))
        self.assertEqual(find_servers(self.flat, env)[2], f"--bin-dir {self.flat}")

    def test_half_packaged_servers_are_not_the_package(self):
        bin_dir = self.package()
        os.remove(os.path.join(bin_dir, "libexec", "muonctl"))
        self.assertEqual(find_servers(None, {"PATH": ""})[2],
                         os.path.join(self.tmp, "bazel-bin"))

    def test_console_scripts_on_path_are_skipped(self):
        scripts = os.path.join(self.tmp, "venv-bin")
        for name in _servers.SERVERS:
            executable(os.path.join(scripts, name),
                       "#!/venv/bin/python\nimport sys\nfrom muond._servers import daemon\n")
        found = find_servers(None, {"PATH": scripts})
        self.assertEqual(found, (self.tree["muond-daemon"], self.tree["muond-coordinator"],
                                 os.path.join(self.tmp, "bazel-bin")))
        # Past them, real binaries later on PATH still count.
        self.assertEqual(find_servers(None, {"PATH": f"{scripts}:{self.flat}"})[2], "PATH")

    def test_servers_dir_names_the_tree_or_the_flat_dir(self):
        tree = find_servers(None, {"PATH": ""})
        self.assertEqual(servers_dir(*tree[:2]), os.path.join(self.tmp, "bazel-bin"))
        self.assertEqual(servers_dir(*find_servers(self.flat, {})[:2]), self.flat)


if __name__ == "__main__":
    unittest.main()
