"""What the launcher says: its log lines, how a process's end is described,
and the last lines of a server's log."""
from __future__ import annotations

import signal
import sys


def tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:]).rstrip("\n")
    except OSError:
        return "(no log)"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


# Whose line it is: `muond launch`'s, unless a trainer's local cluster
# (muond.local) runs the same code (its reaper), which names itself.
LAUNCH_PREFIX = "muond launch"
LOCAL_CLUSTER_PREFIX = "muond local cluster"


def log(message: str, prefix: str = LAUNCH_PREFIX) -> None:
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)
