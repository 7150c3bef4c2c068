"""A server the launcher started (its process, log and health address) and
whether a server answers the standard grpc.health.v1 Check."""
from __future__ import annotations

import subprocess

from muond.launch.messages import describe_exit, tail


def server_answers(address: str, ca_file: str | None = None, timeout: float = 1.0) -> bool:
    """True when a gRPC server answers grpc.health.v1 Check at `address`:
    SERVING, NOT_SERVING or any error status the server itself sent (servers
    built before the health service answer UNIMPLEMENTED); False while
    nothing listens there (UNAVAILABLE, DEADLINE_EXCEEDED)."""
    import grpc
    from muond import health  # the raw call: needs grpcio only
    try:
        health.check(address, timeout=timeout, ca_file=ca_file)
        return True
    except grpc.RpcError as e:
        return e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                grpc.StatusCode.DEADLINE_EXCEEDED)


class Server:
    """The coordinator (rank None) or a daemon, as started."""

    def __init__(self, name: str, rank: int | None, proc: subprocess.Popen, log: str,
                 health_address: str, ca_file: str | None = None):
        self.name, self.rank, self.proc, self.log = name, rank, proc, log
        self.health_address, self.ca_file = health_address, ca_file

    def death_message(self) -> str | None:
        """What to say when it has exited, else None."""
        if self.proc.poll() is None:
            return None
        return (f"{self.name} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}; "
                f"last lines of {self.log}:\n{tail(self.log)}")
