"""The `muond` command (console entry point of the installed package).

    muond --version
    muond health ADDRESS...                   (muond.health: grpc.health.v1 Check)
    muond launch [options] -- <command ...>   (muond.launch: daemons + coordinator
                                               around any trainer command)

Each subcommand lives in its own module with a ``add_parser(subparsers)`` that
registers it and a ``main(args)`` that runs it, so `muond --help` stays fast
(torch is never imported here).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from muond._version import __version__

# subcommand -> module (imported only when that subcommand runs or is listed).
SUBCOMMANDS = {
    "health": "muond.health",
    "launch": "muond.launch",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="muond", description="muond: layer-sharded Muon in an optimizer daemon.")
    parser.add_argument("--version", action="version", version=f"muond {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args.command]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
