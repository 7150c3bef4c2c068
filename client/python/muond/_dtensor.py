"""The one test of "is this a torch DTensor", for placement (params) and
the state conversions (params and state values)."""
from __future__ import annotations


def is_dtensor(value) -> bool:
    """True for a torch.distributed.tensor.DTensor (FSDP2, DTensor TP, HSDP
    params and their state); False for anything else, and always without
    torch.distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without torch.distributed
        return False
    return isinstance(value, DTensor)
