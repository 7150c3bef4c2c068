"""Environment readers shared by the optimizer (placement) and the launcher:
one rule for what an integer environment variable may hold."""
from __future__ import annotations

import os
from collections.abc import Mapping


def env_int(key: str, env: Mapping[str, str] | None = None) -> int | None:
    """``$key`` as a non-negative integer, None when unset or empty. Only
    ASCII digits: str.isdigit() also takes "²" (which int() refuses) and
    "٣" (which int() reads as 3). Raises ValueError naming the variable."""
    env = os.environ if env is None else env
    value = env.get(key, "")
    if value == "":
        return None
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"${key}={value!r} is not a non-negative integer (ASCII digits 0-9)")
    return int(value)
