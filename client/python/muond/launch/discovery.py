"""What the launcher finds on this host: the server binaries (--bin-dir, the
installed package's (a wheel from deploy/wheel.sh), $MUOND_BIN_DIR, PATH, else
the checkout's bazel-bin), muonctl beside them, the GPUs nvidia-smi lists and
the host name's address."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess

from muond import _servers
from muond.launch.errors import LaunchError
from muond.launch.messages import log


def count_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


_DAEMON_IN_TREE = _servers.IN_BAZEL_TREE["muond-daemon"]
_COORDINATOR_IN_TREE = _servers.IN_BAZEL_TREE["muond-coordinator"]


def find_servers(bin_dir: str | None, env, checkout: str | None = None,
                 has_bin_dir_flag: bool = True) -> tuple[str, str, str]:
    """(muond-daemon, muond-coordinator, where from), the one lookup order:
    --bin-dir (given on this command, it always wins), else the servers
    packaged in the installed muond (muond/_bin: a platform wheel), else
    $MUOND_BIN_DIR, else PATH, else the bazel-bin of `checkout` (default: the
    checkout around the current directory); LaunchError saying how to
    provide them (``has_bin_dir_flag`` False: the caller has no --bin-dir, a
    training script's local cluster, so $MUOND_BIN_DIR comes first)."""
    if bin_dir:
        return _servers_in(bin_dir, "--bin-dir")
    packaged = _servers.packaged_bin_dir()
    if packaged:
        if env.get("MUOND_BIN_DIR"):
            log(f"note: the installed muond package's servers ({packaged}) win over "
                f"$MUOND_BIN_DIR {env['MUOND_BIN_DIR']}; pass --bin-dir to use those")
        return _servers_in(packaged, "the installed muond package")
    if env.get("MUOND_BIN_DIR"):
        return _servers_in(env["MUOND_BIN_DIR"], "$MUOND_BIN_DIR")
    found = _servers_on_path(env.get("PATH"))
    if found:
        return found
    repo = checkout or checkout_root(os.getcwd())
    if repo:
        bazel_bin = os.path.join(repo, "bazel-bin")
        coord, daemon = (os.path.join(bazel_bin, rel)
                         for rel in (_COORDINATOR_IN_TREE, _DAEMON_IN_TREE))
        if os.access(coord, os.X_OK) and os.access(daemon, os.X_OK):
            return daemon, coord, bazel_bin
    looked = (f"looked in: the installed muond package (no servers), $MUOND_BIN_DIR "
              f"(unset), PATH, and "
              + (f"{repo}/bazel-bin (not built)" if repo
                 else f"no checkout around {os.getcwd()}"))
    if has_bin_dir_flag:
        where = (f"pass --bin-dir {repo}/bazel-bin" if repo
                 else "pass --bin-dir (a bundle's bin/ or a bazel-bin tree)")
        how = f"{where} or set $MUOND_BIN_DIR"
    else:
        how = ("set $MUOND_BIN_DIR to a bazel-bin tree or a bundle's bin/ (a script run "
               "outside the checkout does not find its bazel-bin)")
    raise LaunchError(f"no muond-coordinator found ({looked}): {how}, put "
                      "muond-coordinator and muond-daemon on PATH, build them (bazel build "
                      "//server/daemon:muond-daemon //server/coordinator:muond-coordinator), "
                      "or install the muond wheel that carries them (deploy/wheel.sh)")


def servers_dir(daemon: str, coordinator: str) -> str:
    """The directory --bin-dir names for two servers find_servers found in
    one: the bazel-bin tree above them, else theirs (a flat bin/)."""
    if (coordinator.endswith(os.sep + _COORDINATOR_IN_TREE)
            and daemon.endswith(os.sep + _DAEMON_IN_TREE)):
        return coordinator[:-len(os.sep + _COORDINATOR_IN_TREE)]
    return os.path.dirname(coordinator)


def _servers_in(given: str, what: str) -> tuple[str, str, str]:
    """Both servers in the directory the user named (flat or a bazel-bin
    tree), else LaunchError naming the one missing."""
    coord = _servers.executable_in(given, "muond-coordinator")
    daemon = _servers.executable_in(given, "muond-daemon")
    if not coord or not daemon:
        missing = "muond-coordinator" if not coord else "muond-daemon"
        raise LaunchError(f"{what} {given}: no executable {missing} there (flat or "
                          f"{_COORDINATOR_IN_TREE if not coord else _DAEMON_IN_TREE})")
    return daemon, coord, f"{what} {given}"


def _which_server(name: str, path: str | None) -> str | None:
    """`name` on PATH, past the console scripts of a muond package."""
    if path is None:
        path = os.environ.get("PATH", os.defpath)
    for directory in path.split(os.pathsep):
        found = shutil.which(name, path=directory) if directory else None
        if found and not _servers.is_console_script(found):
            return found
    return None


def _servers_on_path(path: str | None) -> tuple[str, str, str] | None:
    """Both servers on PATH, each found by its own name; None when neither
    is there; LaunchError when only one is."""
    coord, daemon = (_which_server(name, path)
                     for name in ("muond-coordinator", "muond-daemon"))
    if coord and daemon:
        return daemon, coord, "PATH"
    if coord or daemon:
        raise LaunchError(f"PATH: {coord or daemon} is there but no executable "
                          f"{'muond-daemon' if coord else 'muond-coordinator'}; pass --bin-dir")
    return None


def checkout_root(start: str) -> str | None:
    """The nearest directory at or above `start` holding WORKSPACE: the
    checkout whose bazel-bin holds the servers (the package itself may be
    installed anywhere, a venv's site-packages included)."""
    here = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(here, "WORKSPACE")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def find_muonctl(coordinator_bin: str) -> str:
    """muonctl beside the coordinator (a bundle's bin/), in its bazel-bin
    tree, on PATH, else the bare name."""
    here = os.path.dirname(coordinator_bin)
    tree = os.path.dirname(os.path.dirname(here))
    for path in (os.path.join(here, "muonctl"), os.path.join(tree, "tools", "muonctl", "muonctl")):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return _which_server("muonctl", None) or "muonctl"
