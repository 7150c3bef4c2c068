"""The servers a platform wheel carries, and how they are run.

A wheel made by deploy/wheel.sh holds, beside the client:

    muond/_bin/<name>           a Python wrapper per server (what lookups return):
                                it runs exec_server(<name>)
    muond/_bin/libexec/<name>   the binary itself (muond-daemon, muond-coordinator,
                                muonctl), RPATH into muond.libs/ (auditwheel)

The CUDA libraries the daemon links (cudart, cuBLAS, NCCL: even in host mode)
are left out of the wheel: they come from the host. exec_server puts their
directories on LD_LIBRARY_PATH as deploy/bundle.sh's cuda-paths.sh does:
$MUOND_CUDA_LIB_DIRS (relative entries taken from the current directory),
/usr/local/cuda/lib64 and $LD_LIBRARY_PATH first, else
the nvidia-* wheels (what PyTorch installs, or `pip install 'muond[cuda-libs]'`),
else the loader's cache (ldconfig), else a clear error naming the library.

Without packaged binaries (`pip install ./client/python`, an editable
install) the console scripts say how to get them. Standard library only: the
wrappers may run under any python3.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import struct
import subprocess
import sys

SERVERS = ("muond-daemon", "muond-coordinator", "muonctl")
BIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")
LIBEXEC_DIR = os.path.join(BIN_DIR, "libexec")
# The CUDA libraries wheel.sh leaves out of the wheel (with the driver's
# libcuda): they must match the host's driver and GPU, and cuBLAS alone is
# ~500 MB. soname -> what it is, for the error message.
HOST_CUDA_LIBRARIES = {
    "libcudart.so.13": "the CUDA runtime",
    "libcublas.so.13": "cuBLAS",
    "libcublasLt.so.13": "cuBLASLt",
    "libnccl.so.2": "NCCL",
}
SYSTEM_CUDA_DIR = "/usr/local/cuda/lib64"
EXTRA_DIRS_VAR = "MUOND_CUDA_LIB_DIRS"
HOW_TO_GET_CUDA = (
    "muond-daemon links cudart, cuBLAS and NCCL even in host mode (--host); on a machine "
    "without CUDA install them from PyPI with `pip install 'muond[cuda-libs]'` (or install "
    "torch, whose CUDA wheels bring them), install the CUDA toolkit and NCCL at "
    f"/usr/local/cuda, or name their directories in ${EXTRA_DIRS_VAR} (':'-separated)")
HOW_TO_GET_BINARIES = (
    "this muond package carries no server binaries (a plain `pip install ./client/python` "
    "or an editable install): install the platform wheel (deploy/wheel.sh builds it: "
    "`pip install dist/muond-*-manylinux_*.whl`), or build them in a checkout (`bazel build "
    "-c opt //server/daemon:muond-daemon //server/coordinator:muond-coordinator "
    "//tools/muonctl:muonctl`) and pass `muond launch --bin-dir`, or set $MUOND_BIN_DIR to "
    "the bazel-bin folder or a bundle's bin/ (muond-daemon, muond-coordinator and muonctl "
    "then run those)")
HOW_TO_REINSTALL = (
    "the installed muond package is damaged (an interrupted install or copy): reinstall the "
    "wheel (`pip install --force-reinstall dist/muond-*-manylinux_*.whl`)")


# Where each server lies in a bazel-bin tree (a flat bin/ holds it by name).
IN_BAZEL_TREE = {"muond-daemon": "server/daemon/muond-daemon",
                 "muond-coordinator": "server/coordinator/muond-coordinator",
                 "muonctl": "tools/muonctl/muonctl"}


def executable_in(directory: str, name: str, skip_console_scripts: bool = False) -> str | None:
    """Server `name` in `directory`, flat or as a bazel-bin tree; with
    `skip_console_scripts`, past a muond package's own (is_console_script)."""
    for path in (os.path.join(directory, name), os.path.join(directory, IN_BAZEL_TREE[name])):
        if (os.path.isfile(path) and os.access(path, os.X_OK)
                and not (skip_console_scripts and is_console_script(path))):
            return path
    return None


def is_console_script(path: str) -> bool:
    """True for the console scripts and muond/_bin wrappers of a muond package
    (this module's `run`): they run the packaged servers or $MUOND_BIN_DIR's,
    never a server of their own, so a lookup that found one looks on."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"muond._servers" in head


class ServerError(RuntimeError):
    """A packaged server cannot run: not packaged, or a CUDA library missing."""


def packaged_bin_dir() -> str | None:
    """muond/_bin when every server is packaged there (wrapper and binary),
    else None."""
    for name in SERVERS:
        for path in (os.path.join(BIN_DIR, name), os.path.join(LIBEXEC_DIR, name)):
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                return None
    return BIN_DIR


def needed_libraries(path: str) -> list[str]:
    """DT_NEEDED sonames of an ELF64 little-endian file (its .dynamic
    section); ServerError naming the file when it is not one or is cut short
    (a damaged install), instead of a struct.error from deep in the parse."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:6] != b"\x7fELF\x02\x01":
        raise ServerError(f"{path}: not an ELF64 little-endian executable, as the muond "
                          f"wheel's servers are; {HOW_TO_REINSTALL}")
    try:
        return _dt_needed(data)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise ServerError(f"{path}: a truncated or corrupt ELF file ({len(data)} bytes; its "
                          f"section headers cannot be read: {e}); {HOW_TO_REINSTALL}") from e


def _dt_needed(data: bytes) -> list[str]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # (sh_type, sh_offset, sh_size, sh_link) of each section header
    sections = [struct.unpack_from("<4xI16xQQI", data, shoff + i * shentsize)
                for i in range(shnum)]
    needed = []
    for sh_type, offset, size, link in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][1]
        for entry in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab + value
                needed.append(data[start:data.index(b"\0", start)].decode())
    return needed


def _nvidia_roots() -> list[str]:
    """The `nvidia` namespace package's directories: the one beside this
    package (its site-packages) and those this interpreter imports."""
    roots = [os.path.join(os.path.dirname(os.path.dirname(BIN_DIR)), "nvidia")]
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        roots += [r for r in spec.submodule_search_locations if r not in roots]
    return roots


def _nvidia_wheel_dirs(soname: str) -> list[str]:
    """Directories of the nvidia-* wheels (nvidia/<pkg>/lib) holding `soname`."""
    found = []
    for root in _nvidia_roots():
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", soname))):
            if os.path.dirname(path) not in found:
                found.append(os.path.dirname(path))
    return found


@functools.lru_cache(maxsize=1)
def _loader_cache() -> frozenset:
    """The sonames the loader finds without LD_LIBRARY_PATH (/etc/ld.so.conf's
    directories, as `ldconfig -p` lists them); empty without ldconfig."""
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        return frozenset(line.split(" (", 1)[0].strip() for line in out.splitlines())
    return frozenset()


def _in_loader_cache(soname: str) -> bool:
    return soname in _loader_cache()


def _split(value: str | None) -> list[str]:
    return [d for d in (value or "").split(":") if d]


def _extra_dirs_for(soname: str, searched: list[str]) -> list[str] | None:
    """Directories to add so that the loader finds `soname`: none when it is
    in `searched` or the loader's cache, the nvidia-* wheels' otherwise;
    None when it is nowhere."""
    if any(os.path.exists(os.path.join(d, soname)) for d in searched):
        return []
    wheel_dirs = _nvidia_wheel_dirs(soname)
    if wheel_dirs or _in_loader_cache(soname):
        return wheel_dirs
    return None


def server_env(name: str, env=None) -> dict:
    """The environment packaged server `name` runs in: LD_LIBRARY_PATH with
    the directories of the CUDA libraries it needs; ServerError naming each
    one found nowhere and where it was looked for."""
    env = dict(os.environ if env is None else env)
    user_dirs = _split(env.get("LD_LIBRARY_PATH"))
    # Absolute: the loader would resolve a relative entry against whatever
    # directory the server runs in, not the one the user named it from.
    dirs = [os.path.abspath(d) for d in _split(env.get(EXTRA_DIRS_VAR))] + [SYSTEM_CUDA_DIR]
    missing = []
    for soname in needed_libraries(os.path.join(LIBEXEC_DIR, name)):
        if soname not in HOST_CUDA_LIBRARIES:
            continue
        extra = _extra_dirs_for(soname, dirs + user_dirs)
        if extra is None:
            missing.append(f"{soname} ({HOST_CUDA_LIBRARIES[soname]})")
        dirs += [d for d in extra or () if d not in dirs]
    if missing:
        raise ServerError(
            f"{name}: {', '.join(missing)} not found: looked in ${EXTRA_DIRS_VAR}, "
            f"{SYSTEM_CUDA_DIR}, $LD_LIBRARY_PATH, the nvidia-* wheels (beside muond and "
            f"of {sys.executable}) and the loader's cache (ldconfig -p). {HOW_TO_GET_CUDA}")
    env["LD_LIBRARY_PATH"] = ":".join(dirs + user_dirs)
    return env


def exec_server(name: str, args: list[str]) -> None:
    """Replaces this process with packaged server `name`; ServerError when
    it cannot run."""
    if packaged_bin_dir() is None:
        # A package without servers runs $MUOND_BIN_DIR's (a bundle's bin/ or
        # a bazel-bin tree), as `muond launch` finds them.
        given = os.environ.get("MUOND_BIN_DIR")
        found = executable_in(given, name, skip_console_scripts=True) if given else None
        if found is None:
            raise ServerError(f"{name}: {HOW_TO_GET_BINARIES}")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(found, [found, *args])
    binary = os.path.join(LIBEXEC_DIR, name)
    env = server_env(name)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(binary, [name, *args], env)


def run(name: str) -> int:
    """A console script (`muond-daemon`, `muond-coordinator`, `muonctl`):
    exec the packaged binary; exit 127 with one line saying why not."""
    try:
        exec_server(name, sys.argv[1:])
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced the process


# muond/_bin/<name>: what a lookup returns (muond.launch.discovery), runnable
# as a path; any python3 works (this module needs the standard library only).
WRAPPER = """#!/usr/bin/env python3
# Runs libexec/{name} of the muond package around it (muond/_servers.py).
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
from muond._servers import run
sys.exit(run({name!r}))
"""


def write_wrappers(bin_dir: str) -> None:
    """Writes the wrapper of every server into bin_dir (deploy/wheel.sh)."""
    for name in SERVERS:
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(WRAPPER.format(name=name))
        os.chmod(path, 0o755)


def daemon() -> int:
    return run("muond-daemon")


def coordinator() -> int:
    return run("muond-coordinator")


def muonctl() -> int:
    return run("muonctl")


if __name__ == "__main__":
    # deploy/wheel.sh: python3 -m muond._servers write-wrappers DIR
    if sys.argv[1:2] != ["write-wrappers"] or len(sys.argv) != 3:
        sys.exit("usage: python3 -m muond._servers write-wrappers DIR")
    write_wrappers(sys.argv[2])
