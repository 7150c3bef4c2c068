"""argparse `type=` converters shared by the `muond` subcommands and the demo
launcher (deploy/local/launch.py): one wording for every refused number."""
from __future__ import annotations

import argparse
import math


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def port(text: str) -> int:
    value = integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def count(text: str) -> int:
    """An integer >= 1."""
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def index(text: str) -> int:
    """An integer >= 0."""
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def seconds(text: str) -> float:
    """A finite duration > 0 (inf and nan are refused: a wait must end)."""
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 and finite (seconds)")
    return value


def seconds_or_off(text: str) -> float:
    """A finite duration >= 0, where 0 turns the feature off."""
    value = _number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (seconds; 0 = off)")
    return value
