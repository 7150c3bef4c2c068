"""On the coordinator's node, while the command runs: every rank of the job
must join the coordinator within --join-timeout, else the launch fails
naming the missing ranks and their nodes (their launchers may never have
started)."""
from __future__ import annotations

import time

from muond.launch.config import LaunchLayout
from muond.launch.errors import ServerDied


class JoinWatch:
    """Asks the coordinator (ListDaemons) at most once a second which ranks
    joined; stops asking once all did."""

    def __init__(self, layout: LaunchLayout, args):
        self.layout, self.args = layout, args
        self.coordinator: str | None = None
        self.token_file: str | None = None
        self.deadline: float | None = None  # watching the job's membership until
        self.next_check = 0.0
        self._token: str | None = None

    def wanted(self) -> bool:
        """The coordinator's launcher watches the job's membership when other
        launchers start some of its daemons."""
        return (self.layout.start_coordinator and self.args.join_timeout > 0
                and len(self.layout.ranks) < self.layout.world_size)

    def start(self, coordinator: str, token_file: str) -> None:
        """The command started: the --join-timeout clock starts (if wanted)."""
        self.coordinator, self.token_file = coordinator, token_file
        if self.wanted():
            self.deadline = time.monotonic() + self.args.join_timeout

    def joined_ranks(self) -> tuple[set, str]:
        """(ranks the coordinator lists for the job, error text or "")."""
        import grpc
        from muond.client import TOKEN_METADATA_KEY, read_token_file
        from muond.v1 import muond_pb2 as pb
        if self._token is None:
            try:
                self._token = read_token_file(self.token_file)
            except (OSError, ValueError) as e:
                return set(), str(e)
        ca = self.args.tls_ca if self.args.tls_cert else None
        if ca:
            with open(ca, "rb") as f:
                channel = grpc.secure_channel(self.coordinator,
                                              grpc.ssl_channel_credentials(f.read()))
        else:
            channel = grpc.insecure_channel(self.coordinator)
        with channel:
            call = channel.unary_unary("/muond.v1.Coordinator/ListDaemons",
                                       request_serializer=pb.ListDaemonsRequest.SerializeToString,
                                       response_deserializer=pb.ListDaemonsResponse.FromString)
            try:
                response = call(pb.ListDaemonsRequest(job_id=self.layout.job_id), timeout=5,
                                metadata=[(TOKEN_METADATA_KEY, self._token)])
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return set(), ""  # no daemon of the job joined yet
                return set(), f"ListDaemons: {e.code().name}: {e.details()}"
        return {d.rank for d in response.daemons}, ""

    def check(self) -> None:
        """Called while the command runs: once every rank joined, stop
        watching; past --join-timeout, ServerDied naming who is missing."""
        if self.deadline is None or time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + 1.0
        joined, error = self.joined_ranks()
        missing = sorted(set(range(self.layout.world_size)) - joined)
        if not missing:
            self.deadline = None
            return
        if time.monotonic() > self.deadline:
            raise ServerDied(self._missing_message(missing, error))

    def _missing_message(self, missing: list, error: str) -> str:
        nproc = self.layout.nproc_per_node
        nodes = sorted({r // nproc for r in missing})
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        return (
            f"job {self.layout.job_id}: {len(missing)} of {self.layout.world_size} daemons "
            f"did not join the coordinator within {self.args.join_timeout:g} s "
            f"(--join-timeout): rank{'s' if len(missing) > 1 else ''} {shown} on node "
            f"rank{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes[:16]))} "
            f"(rank // --nproc-per-node {nproc}); check those nodes' launchers and "
            f"logs (same --job-id, token, --master-addr){'; ' + error if error else ''}")
