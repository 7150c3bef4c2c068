"""muond/_servers.py: how a packaged server runs. The CUDA libraries the real
muond-daemon needs (its DT_NEEDED, as readelf reads it) are put on
LD_LIBRARY_PATH from $MUOND_CUDA_LIB_DIRS or the nvidia-* wheels' layout; one
found nowhere is named with where it was looked for and how to get it; the
servers that need none (muonctl) run without; relative extra directories
become absolute; a damaged (truncated, not ELF) binary is named with "reinstall
the wheel"; a package without binaries says how to get them.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

from muond import _servers

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DAEMON = os.path.join(RUNFILES, "server", "daemon", "muond-daemon")
MUONCTL = os.path.join(RUNFILES, "tools", "muonctl", "muonctl")


def readelf_needed(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()


class ServerEnvTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp)
        libexec = os.path.join(self.tmp, "site", "muond", "_bin", "libexec")
        os.makedirs(libexec)
        os.symlink(DAEMON, os.path.join(libexec, "muond-daemon"))
        os.symlink(MUONCTL, os.path.join(libexec, "muonctl"))
        # A host without CUDA: no /usr/local/cuda, no ldconfig entry, and no
        # nvidia-* wheels but those a test lays out beside the package.
        empty = os.path.join(self.tmp, "no-cuda")
        os.mkdir(empty)
        for target, value in (("BIN_DIR", os.path.dirname(libexec)), ("LIBEXEC_DIR", libexec),
                              ("SYSTEM_CUDA_DIR", empty)):
            self.patch(target, value)
        self.patch("_in_loader_cache", lambda soname: False)
        self.patch("_nvidia_roots", lambda: [os.path.join(self.tmp, "site", "nvidia")])

    def patch(self, name, value):
        patcher = mock.patch.object(_servers, name, value)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_needed_libraries_as_readelf_reads_them(self):
        self.assertEqual(_servers.needed_libraries(DAEMON), readelf_needed(DAEMON))
        self.assertTrue(set(_servers.HOST_CUDA_LIBRARIES) <= set(readelf_needed(DAEMON)))

    def test_missing_cuda_libraries_named_with_where_and_how(self):
        with self.assertRaises(_servers.ServerError) as cm:
            _servers.server_env("muond-daemon", {})
        message = str(cm.exception)
        for soname, what in _servers.HOST_CUDA_LIBRARIES.items():
            self.assertIn(f"{soname} ({what})", message)
        for where in ("$MUOND_CUDA_LIB_DIRS", "$LD_LIBRARY_PATH", "nvidia-* wheels",
                      "ldconfig -p", "pip install 'muond[cuda-libs]'", "/usr/local/cuda"):
            self.assertIn(where, message)

    def test_muonctl_needs_no_cuda_library(self):
        env = _servers.server_env("muonctl", {"LD_LIBRARY_PATH": "/x"})
        self.assertEqual(env["LD_LIBRARY_PATH"].split(":")[-1], "/x")

    def test_extra_dirs_first_then_the_wheels_layout(self):
        extra = os.path.join(self.tmp, "extra")
        touch(os.path.join(extra, "libnccl.so.2"))
        site = os.path.join(self.tmp, "site", "nvidia")
        for soname in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
            touch(os.path.join(site, "cu13", "lib", soname))
        env = _servers.server_env("muond-daemon", {"MUOND_CUDA_LIB_DIRS": extra,
                                                   "LD_LIBRARY_PATH": "/user"})
        self.assertEqual(env["LD_LIBRARY_PATH"].split(":"),
                         [extra, _servers.SYSTEM_CUDA_DIR, os.path.join(site, "cu13", "lib"),
                          "/user"])
        # Without the extra dir, NCCL is missing alone.
        with self.assertRaisesRegex(_servers.ServerError, r"muond-daemon: libnccl\.so\.2 "
                                    r"\(NCCL\) not found: looked in"):
            _servers.server_env("muond-daemon", {})

    def test_relative_extra_dirs_are_made_absolute_from_the_current_directory(self):
        extra = os.path.join(self.tmp, "extra")
        for soname in _servers.HOST_CUDA_LIBRARIES:
            touch(os.path.join(extra, soname))
        cwd = os.getcwd()
        os.chdir(self.tmp)
        self.addCleanup(os.chdir, cwd)
        env = _servers.server_env("muond-daemon", {"MUOND_CUDA_LIB_DIRS": "extra"})
        self.assertEqual(env["LD_LIBRARY_PATH"].split(":")[0], extra)

    def install_damaged_daemon(self, content: bytes) -> str:
        path = os.path.join(_servers.LIBEXEC_DIR, "muond-daemon")
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(content)
        return path

    def test_a_truncated_server_binary_names_the_file_and_reinstall(self):
        with open(DAEMON, "rb") as f:
            head = f.read(200)  # the ELF header, cut before the section headers
        path = self.install_damaged_daemon(head)
        with self.assertRaises(_servers.ServerError) as cm:
            _servers.server_env("muond-daemon", {})
        message = str(cm.exception)
        self.assertIn(f"{path}: a truncated or corrupt ELF file (200 bytes", message)
        self.assertIn("reinstall the wheel", message)

    def test_a_server_binary_that_is_no_elf_names_the_file_and_reinstall(self):
        path = self.install_damaged_daemon(b"")
        with self.assertRaisesRegex(_servers.ServerError,
                                    rf"{re.escape(path)}: not an ELF64 .*reinstall the wheel"):
            _servers.server_env("muond-daemon", {})


class NotPackagedTest(unittest.TestCase):
    def test_console_script_says_how_to_get_the_binaries(self):
        # The package Bazel's runfiles hold has no muond/_bin.
        proc = subprocess.run([sys.executable, "-c", "import sys; from muond._servers import "
                               "daemon; sys.exit(daemon())"], capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(proc.returncode, 127, proc.stderr)
        self.assertIn("error: muond-daemon: this muond package carries no server binaries",
                      proc.stderr)
        self.assertIn("deploy/wheel.sh", proc.stderr)
        self.assertIn("--bin-dir", proc.stderr)

    def test_console_script_runs_the_bin_dirs_server(self):
        # A stand-in muonctl in a bazel-bin tree under $MUOND_BIN_DIR runs with
        # the script's arguments; a muond console script there is passed over.
        with tempfile.TemporaryDirectory() as d:
            tree = os.path.join(d, "tools", "muonctl")
            os.makedirs(tree)
            fake = os.path.join(tree, "muonctl")
            with open(fake, "w") as f:
                f.write('#!/bin/sh\necho "ran $0 with $*"\n')
            os.chmod(fake, 0o755)
            script = os.path.join(d, "muonctl")  # a console script: skipped
            with open(script, "w") as f:
                f.write("#!/usr/bin/env python3\nfrom muond._servers import run\n")
            os.chmod(script, 0o755)
            proc = subprocess.run(
                [sys.executable, "-c", "import sys; from muond._servers import muonctl; "
                 "sys.exit(muonctl())", "status", "--job", "j"],
                capture_output=True, text=True, timeout=60,
                env={**os.environ, "MUOND_BIN_DIR": d})
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), f"ran {fake} with status --job j")


if __name__ == "__main__":
    unittest.main()
