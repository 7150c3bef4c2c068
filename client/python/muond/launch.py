"""`muond launch`: placeholder registered by muond.cli; issue 21's launcher replaces it."""
from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("launch", help="start daemons + coordinator around a command")
    p.add_argument("command", nargs="*")
    return p


def main(args) -> int:
    raise SystemExit("muond launch: not built yet (issue 21)")
