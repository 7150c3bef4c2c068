"""Reads a shared case table of tests/rules (the same JSON file a C++ test runs
the daemon's rule on)."""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str) -> dict:
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def number(value):
    """A JSON number, or "inf" / "-inf" / "nan" (JSON has no literal for them)."""
    return float(value) if isinstance(value, str) else value
