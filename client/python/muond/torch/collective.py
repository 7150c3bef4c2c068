"""What the ranks of a distributed job (torch.distributed's default group)
agree on together: the rank and world, and whether every rank registered."""
from __future__ import annotations

import torch

from muond.client import MuondError


def process_rank() -> tuple[int, int]:
    """(rank, world) of torch.distributed's default group, (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _first_refusal(mine: dict | None):
    """Every rank's refusal (None: agreed) gathered: None when no rank
    refused, else (the first refusing rank, its refusal, the others that
    refused). The same on every rank."""
    failed = [(r, f) for r, f in enumerate(all_gather_object(mine)) if f is not None]
    if not failed:
        return None
    r, first = failed[0]
    return r, first, [f for f, _ in failed[1:]]


def agree_registered(refused: BaseException | None, rank: int) -> None:
    """Every rank of a distributed job learns whether every other rank's
    RegisterParams succeeded, and all raise the first refusal alike
    (``rank r: <reason>``, a MuondError with its code, reason and metadata)."""
    mine = None
    if refused is not None:
        mine = {"message": str(refused), "code": getattr(refused, "code", None),
                "reason": getattr(refused, "reason", ""),
                "metadata": dict(getattr(refused, "metadata", None) or {})}
    found = _first_refusal(mine)
    if found is None:
        return
    r, first, others = found
    raise MuondError(f"rank {r}: RegisterParams refused: {first['message']}"
                     + (f" (ranks {others} refused too)" if others else ""),
                     code=first["code"], reason=first["reason"],
                     metadata=first["metadata"]) from refused


# The refusals agree() raises of their own type; any other is a ValueError.
_AGREED_TYPES = {"TypeError": TypeError, "RuntimeError": RuntimeError}


def agree(refused: BaseException | None, rank: int, what: str) -> None:
    """Every rank learns whether any rank refused ``what`` (a ValueError,
    TypeError or RuntimeError raised before anything changed), and all raise
    the first refusal alike (``what: rank r: <reason>``), of its type."""
    found = _first_refusal(None if refused is None else {"message": str(refused),
                                                         "type": type(refused).__name__})
    if found is None:
        return
    r, first, _ = found
    kind = _AGREED_TYPES.get(first["type"], ValueError)
    raise kind(f"{what}: rank {r}: {first['message']}") from refused
