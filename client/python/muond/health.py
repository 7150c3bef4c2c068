"""`muond health ADDRESS...`: ask servers the standard grpc.health.v1 Check.

For probes that cannot speak gRPC to a Unix socket (a Kubernetes `grpc:` probe
needs a TCP port; muond daemons listen on Unix sockets): an `exec` probe runs
`muond health /run/muond/sock/*.sock`. Exit 0 when every address answered;
by default any answer counts (a daemon is NOT_SERVING until trainers
registered and a plan arrived, yet alive), `--serving` asks for SERVING.
Exit 1 naming the first address that did not answer (or was not SERVING).

An address is HOST:PORT, unix:///PATH or a socket path. The health service
needs no token. The request and response are encoded here (two one-field
messages), so this needs grpcio only, not grpcio-health-checking.
"""
from __future__ import annotations

import argparse
import sys

CHECK = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _encode_request(service: str) -> bytes:
    """HealthCheckRequest{service}: field 1, length-delimited."""
    data = service.encode()
    if not data:
        return b""
    if len(data) > 127:
        raise ValueError(f"--service '{service}' is longer than 127 bytes")
    return b"\x0a" + bytes([len(data)]) + data


def _decode_status(data: bytes) -> int:
    """HealthCheckResponse.status (field 1, varint); absent means UNKNOWN (0)."""
    if len(data) >= 2 and data[0] == 0x08:
        return data[1] & 0x7F
    return 0


def _target(address: str) -> str:
    return f"unix://{address}" if address.startswith("/") else address


def check(address: str, service: str = "", timeout: float = 2.0,
          ca_file: str | None = None) -> str:
    """Returns the status name the server at `address` answers for `service`
    (UNIMPLEMENTED from a server without the health service); raises
    grpc.RpcError when it does not answer within `timeout` seconds. With
    `ca_file` (PEM) the channel is TLS, verified with it."""
    import grpc  # only when a check runs: `muond --help` stays light

    if ca_file:
        with open(ca_file, "rb") as f:
            channel = grpc.secure_channel(_target(address),
                                          grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(_target(address))
    with channel:
        call = channel.unary_unary(CHECK, request_serializer=None,
                                   response_deserializer=None)
        try:
            reply = call(_encode_request(service), timeout=timeout)
        except grpc.RpcError as e:
            # A server without the health service still answered: alive.
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "UNIMPLEMENTED"
            raise
    return STATUS_NAMES.get(_decode_status(reply), "UNKNOWN")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "health", help="grpc.health.v1 Check of muond servers (exit 0: all answered)",
        description=__doc__.split("\n\n")[1])
    parser.add_argument("addresses", nargs="+", metavar="ADDRESS",
                        help="HOST:PORT, unix:///PATH or a socket path")
    parser.add_argument("--service", default="",
                        help='service name to check ("" = the server, or muond.v1.Optimizer)')
    parser.add_argument("--serving", action="store_true",
                        help="succeed only on SERVING (default: any answer)")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="seconds to wait for each answer (default 2)")


def main(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print(f"muond health: --timeout={args.timeout} must be > 0", file=sys.stderr)
        return 2
    import grpc

    for address in args.addresses:
        try:
            status = check(address, args.service, args.timeout)
        except grpc.RpcError as e:
            print(f"muond health: {address}: no answer ({e.code().name}: {e.details()})",
                  file=sys.stderr)
            return 1
        if args.serving and status != "SERVING":
            print(f"muond health: {address}: {status}, --serving asks for SERVING",
                  file=sys.stderr)
            return 1
        print(f"{address}: {status}")
    return 0
