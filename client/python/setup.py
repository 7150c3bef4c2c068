"""Build hook of the `muond` package (metadata: pyproject.toml).

The muond.v1 gRPC stubs are generated at build time from the .proto files with
grpcio-tools (a build requirement) and never committed. The protos live in the
repository's top-level proto/, outside this project directory, so they are
looked up in two places:

* ``proto/`` next to this file: an sdist, whose sdist command (below) copies
  them there, since an sdist can only carry files under the project directory;
* ``../../proto``: a repository checkout (pip builds a local directory in place).

Protos are compiled with ``--proto_path`` at that proto root, so
``proto/muond/v1/muond.proto`` becomes ``muond/v1/muond_pb2.py`` and the
generated imports read ``from muond.v1 import ...``.

deploy/wheel.sh builds from a copy of this directory with the server binaries
in ``muond/_bin/`` (muond/_servers.py): then the wheel is a platform wheel,
``py3-none-linux_x86_64`` (the binaries do not use the Python ABI), which
auditwheel repairs into the manylinux one. Without them it stays pure.
"""
from __future__ import annotations

import glob
import os
import shutil

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_SUBDIR = os.path.join("muond", "v1")
PROTO_ROOTS = (
    os.path.join(HERE, "proto"),  # an sdist's copy
    os.path.normpath(os.path.join(HERE, "..", "..", "proto")),  # the repository's
)


def find_protos() -> tuple[str, list[str]]:
    """(proto root, .proto paths relative to it) from the first root that has any."""
    for root in PROTO_ROOTS:
        found = sorted(glob.glob(os.path.join(root, PROTO_SUBDIR, "*.proto")))
        if found:
            return root, [os.path.relpath(p, root) for p in found]
    raise SystemExit(
        "muond build: no .proto files in "
        + " or ".join(os.path.join(r, PROTO_SUBDIR) for r in PROTO_ROOTS)
        + "; build from a muond checkout (pip install ./client/python) or from an sdist"
        " made from one (it carries proto/)")


def generate_stubs(out_dir: str) -> None:
    """Writes muond/v1/*_pb2.py and *_pb2_grpc.py under out_dir."""
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise SystemExit(f"muond build: grpcio-tools is needed to generate the gRPC stubs ({e}); "
                         "it is a build requirement (pyproject.toml); with "
                         "--no-build-isolation install it first") from e
    import importlib.resources

    root, protos = find_protos()
    # The well-known types (google/protobuf/any.proto) that grpc_tools bundles;
    # `python -m grpc_tools.protoc` adds them itself, protoc.main does not.
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    os.makedirs(os.path.join(out_dir, PROTO_SUBDIR), exist_ok=True)
    args = ["grpc_tools.protoc", f"--proto_path={root}", f"--proto_path={well_known}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"muond build: grpc_tools.protoc failed on {', '.join(protos)} "
                         f"in {root} (its message is above)")


class BuildPyWithStubs(build_py):
    def find_package_modules(self, package, package_dir):
        # Stubs left in the source tree (an editable install, an old checkout)
        # are neither built nor put in an sdist: the build generates its own.
        return [m for m in super().find_package_modules(package, package_dir)
                if not m[1].endswith(("_pb2", "_pb2_grpc"))]

    def run(self) -> None:
        # build_py only adds and overwrites: a module deleted from the source
        # would otherwise live on in build_lib (and in the wheel).
        shutil.rmtree(os.path.join(self.build_lib, "muond"), ignore_errors=True)
        super().run()
        # Editable installs import from the source tree, so the stubs go there
        # (they are .gitignored); a regular build writes them into build_lib.
        generate_stubs(HERE if self.editable_mode else self.build_lib)


def has_server_binaries() -> bool:
    return bool(glob.glob(os.path.join(HERE, "muond", "_bin", "libexec", "*")))


class DistributionWithBinaries(Distribution):
    def has_ext_modules(self) -> bool:
        # Binaries go to platlib and make the wheel impure, as extensions do.
        return super().has_ext_modules() or has_server_binaries()


class PlatformWheelWithBinaries(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        # Any Python 3: the binaries are executables, not extension modules.
        return ("py3", "none", plat) if not self.root_is_pure else (python, abi, plat)


class SdistWithProtos(sdist):
    def make_release_tree(self, base_dir: str, files) -> None:
        super().make_release_tree(base_dir, files)
        root, protos = find_protos()
        for rel in protos:
            dst = os.path.join(base_dir, "proto", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.join(root, rel), dst)


setup(
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos,
              "bdist_wheel": PlatformWheelWithBinaries},
    distclass=DistributionWithBinaries,
    # Not setuptools' default build/: next to Bazel's BUILD file it collides on
    # a case-insensitive filesystem.
    options={"build": {"build_base": ".setuptools-build"}},
)
