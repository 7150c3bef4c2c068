"""`pip install ./client/python` into a fresh virtual environment (with build
isolation: setuptools and grpcio-tools come from PyPI or pip's cache) gives
`import muond` with the version of muond/_version.py, the `muond` command, the
muond.v1 stubs generated at build time (a gRPC call through them), and
muond.torch.Muon once a torch is visible; an sdist carries the protos and
builds the same wheel; a tree without the protos fails naming the path.

The package is installed from a copy of client/python and proto/ (runfiles are
symlinks, and the build writes into its source directory). The fresh venv never
sees the repository: PYTHONPATH is dropped, and muond.__file__ must be inside it.
"""
import ast
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PIP_TIMEOUT_S = 600


def package_version(path: str) -> str:
    """__version__ from _version.py, read without importing the package."""
    with open(path) as f:
        for node in ast.parse(f.read()).body:
            if (isinstance(node, ast.Assign) and node.targets[0].id == "__version__"):
                return ast.literal_eval(node.value)
    raise AssertionError(f"no __version__ in {path}")


def copy_tree(rel: str, dst_root: str) -> None:
    """runfiles/rel -> dst_root/rel as real files (runfiles are symlinks)."""
    shutil.copytree(os.path.join(RUNFILES, rel), os.path.join(dst_root, rel),
                    ignore=shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2_grpc.py"))


def clean_env(venv: str) -> dict:
    """The environment of a process in `venv`: nothing of Bazel's PYTHONPATH
    (it holds the repository's client/python) or of the project's venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = venv
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    if not pip_cache_writable():
        env["PIP_NO_CACHE_DIR"] = "1"  # a read-only cache fails `pip wheel`
    return env


def pip_cache_writable() -> bool:
    cache = (os.environ.get("PIP_CACHE_DIR")
             or os.path.join(os.path.expanduser("~"), ".cache", "pip"))
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:
        return False
    return os.access(cache, os.W_OK)


def site_packages(python: str, env: dict) -> str:
    return subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env, text=True).strip()


# Runs in the fresh venv: a servicer and a stub from the installed muond.v1 talk
# over a Unix socket; error_details messages round-trip through bytes.
STUB_ROUND_TRIP = r"""
import os, sys, tempfile, shutil
from concurrent import futures
import grpc
from muond.v1 import error_details_pb2, muond_pb2, muond_pb2_grpc

class Optimizer(muond_pb2_grpc.OptimizerServicer):
    def Health(self, request, context):
        return muond_pb2.HealthResponse(serving=True, has_plan=False)

d = tempfile.mkdtemp(dir="/tmp")
server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
try:
    muond_pb2_grpc.add_OptimizerServicer_to_server(Optimizer(), server)
    address = f"unix://{d}/s.sock"
    server.add_insecure_port(address)
    server.start()
    with grpc.insecure_channel(address) as channel:
        reply = muond_pb2_grpc.OptimizerStub(channel).Health(muond_pb2.HealthRequest(), timeout=30)
    assert reply.serving and not reply.has_plan, reply
    info = error_details_pb2.ErrorInfo(reason="PLAN_STALE", domain="muond")
    assert error_details_pb2.ErrorInfo.FromString(info.SerializeToString()) == info
    print(muond_pb2.__file__)
finally:
    server.stop(None)
    shutil.rmtree(d, ignore_errors=True)
"""


class PipInstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="muond-pip-")
        cls.src = os.path.join(cls.tmp, "repo")
        copy_tree(os.path.join("client", "python"), cls.src)
        copy_tree("proto", cls.src)
        cls.version = package_version(
            os.path.join(cls.src, "client", "python", "muond", "_version.py"))
        cls.venv = os.path.join(cls.tmp, "venv")
        cls.python = os.path.join(cls.venv, "bin", "python")
        cls.env = clean_env(cls.venv)
        try:
            subprocess.run([sys.executable, "-m", "venv", cls.venv], check=True,
                           capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
            cls.pip(["install", os.path.join(cls.src, "client", "python")])
            cls.site = site_packages(cls.python, cls.env)
        except BaseException:
            shutil.rmtree(cls.tmp, ignore_errors=True)
            raise

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def pip(cls, args):
        proc = subprocess.run([cls.python, "-m", "pip", *args], env=cls.env,
                              capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if proc.returncode != 0:
            raise AssertionError(f"pip {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def run_in_venv(self, argv, **kw):
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=120, cwd=self.tmp, **kw)
        self.assertEqual(proc.returncode, 0, f"{argv}: {proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def assertInVenv(self, path):
        self.assertTrue(os.path.realpath(path).startswith(os.path.realpath(self.site) + os.sep),
                        f"{path} is not in the fresh venv's {self.site}")

    def test_import_and_version(self):
        out = self.run_in_venv([self.python, "-c",
                                "import muond; print(muond.__version__); print(muond.__file__)"])
        version, path = out.split()
        self.assertEqual(version, self.version)
        self.assertInVenv(path)
        # Its dependencies were installed into the fresh venv, not borrowed.
        out = self.run_in_venv([self.python, "-c",
                                "import grpc, google.protobuf, grpc_health, numpy\n"
                                "for m in (grpc, google.protobuf, grpc_health, numpy):\n"
                                "    print(m.__file__)"])
        for path in out.split():
            self.assertInVenv(path)

    def test_cli(self):
        muond = os.path.join(self.venv, "bin", "muond")
        self.assertEqual(self.run_in_venv([muond, "--version"]).strip(), f"muond {self.version}")
        self.assertIn("launch", self.run_in_venv([muond, "launch", "--help"]))

    def test_stubs_round_trip(self):
        self.assertInVenv(self.run_in_venv([self.python, "-c", STUB_ROUND_TRIP]).strip())

    def test_torch_muon_with_project_torch_visible(self):
        # The project venv's site-packages *after* the fresh venv's own (a .pth
        # line appends), so torch comes from there and muond still from here.
        project_site = site_packages(sys.executable, clean_env(sys.prefix))
        pth = os.path.join(self.site, "zz_project_site.pth")
        with open(pth, "w") as f:
            f.write(project_site + "\n")
        self.addCleanup(os.remove, pth)
        out = self.run_in_venv([self.python, "-c",
                                "import torch, muond, muond.torch\n"
                                "assert issubclass(muond.torch.Muon, torch.optim.Optimizer)\n"
                                "print(muond.__file__); print(torch.__file__)"])
        muond_file, torch_file = out.split()
        self.assertInVenv(muond_file)
        self.assertTrue(os.path.realpath(torch_file).startswith(os.path.realpath(project_site)))

    def test_sdist_carries_protos_and_builds(self):
        dist = os.path.join(self.tmp, "dist")
        project = os.path.join(self.tmp, "sdist-src", "client", "python")
        # A copy of its own: an sdist build writes muond.egg-info into the tree.
        shutil.copytree(os.path.join(self.src, "client", "python"), project)
        shutil.copytree(os.path.join(self.src, "proto"),
                        os.path.join(self.tmp, "sdist-src", "proto"))
        # The project venv has setuptools and grpcio-tools (the build requirements).
        subprocess.run([sys.executable, "-c",
                        f"from setuptools import build_meta; build_meta.build_sdist({dist!r})"],
                       cwd=project, env=clean_env(sys.prefix), check=True,
                       capture_output=True, timeout=120)
        (sdist,) = os.listdir(dist)
        with tarfile.open(os.path.join(dist, sdist)) as tar:
            names = tar.getnames()
        top = f"muond-{self.version}"
        for proto in ("muond.proto", "error_details.proto"):
            self.assertIn(f"{top}/proto/muond/v1/{proto}", names)
        # pip unpacks the sdist alone in a temporary directory: no ../../proto.
        # The project venv's pip, without build isolation (offline; the fresh
        # venv's install already built in isolation).
        wheels = os.path.join(self.tmp, "wheels")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "-w", wheels, os.path.join(dist, sdist)],
            env=clean_env(sys.prefix), capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        (wheel,) = os.listdir(wheels)
        with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
            names = z.namelist()
            entry_points = z.read(f"muond-{self.version}.dist-info/entry_points.txt").decode()
        for stub in ("muond_pb2.py", "muond_pb2_grpc.py", "error_details_pb2.py"):
            self.assertIn(f"muond/v1/{stub}", names)
        self.assertIn("muond = muond.cli:main", entry_points)

    def test_missing_protos_named(self):
        project = os.path.join(self.tmp, "no-protos", "client", "python")
        shutil.copytree(os.path.join(self.src, "client", "python"), project)
        proc = subprocess.run(
            [sys.executable, "-c",
             f"from setuptools import build_meta; build_meta.build_wheel({self.tmp + '/w'!r})"],
            cwd=project, env=clean_env(sys.prefix), capture_output=True, text=True, timeout=120)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn(os.path.join(self.tmp, "no-protos", "proto", "muond", "v1"), proc.stderr)
        self.assertIn("no .proto files", proc.stderr)


if __name__ == "__main__":
    unittest.main()
