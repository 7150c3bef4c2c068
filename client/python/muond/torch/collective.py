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


def agree_registered(refused: BaseException | None, rank: int) -> None:
    """Every rank of a distributed job learns whether every other rank's
    RegisterParams succeeded, and all raise the first refusal alike
    (``rank r: <reason>``, a MuondError with its code, reason and metadata)."""
    mine = None
    if refused is not None:
        mine = {"message": str(refused), "code": getattr(refused, "code", None),
                "reason": getattr(refused, "reason", ""),
                "metadata": dict(getattr(refused, "metadata", None) or {})}
    every = all_gather_object(mine)
    failed = [(r, f) for r, f in enumerate(every) if f is not None]
    if not failed:
        return
    r, first = failed[0]
    others = [f for f, _ in failed[1:]]
    raise MuondError(f"rank {r}: RegisterParams refused: {first['message']}"
                     + (f" (ranks {others} refused too)" if others else ""),
                     code=first["code"], reason=first["reason"],
                     metadata=first["metadata"]) from refused


def agree(refused: BaseException | None, rank: int, what: str) -> None:
    """Every rank learns whether any rank refused ``what`` (a ValueError or
    TypeError raised before anything changed), and all raise the first
    refusal alike (``what: rank r: <reason>``), of its type."""
    mine = None if refused is None else {"message": str(refused),
                                         "type": type(refused).__name__}
    failed = [(r, f) for r, f in enumerate(all_gather_object(mine)) if f is not None]
    if not failed:
        return
    r, first = failed[0]
    kind = TypeError if first["type"] == "TypeError" else ValueError
    raise kind(f"{what}: rank {r}: {first['message']}") from refused
