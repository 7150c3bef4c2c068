"""A group's optimizer-state options: ``state_dtype`` ("auto", "fp32", "bf16",
"fp8_e4m3") and ``state_location`` ("device", "host"), either algorithm's
(muond.torch.options StateStorageOptions; core/common/state_options.h). The
names are the wire enums' (muond.wire_enums). "auto" stays in the group and
goes on the wire resolved (``wire_dtype``). They are fixed at registration,
but a state dict saved with other ones loads: the daemons' import converts
each value, rounding to this group's dtype."""
from __future__ import annotations

import torch

from muond import wire_enums as _wire_enums

KEYS = tuple(_wire_enums.STATE_ENUM_FIELDS)


def wire_dtype(group: dict) -> str:
    """The group's state_dtype as the daemons apply it: "auto" by torch's
    rule over every param of the group (bf16 when all are bf16, else fp32,
    as core/common/state_options.h AutoStateDType). Resolved here and sent
    concrete because a daemon sees only the params it holds: left to each
    daemon, one param's state dtype would depend on where it was placed.
    tests/rules/auto_state_dtype_cases.json holds both copies to one table."""
    dtype = group.get("state_dtype") or _wire_enums.AUTO_STATE_DTYPE
    if dtype != _wire_enums.AUTO_STATE_DTYPE:
        return dtype
    params = list(group.get("params", ()))
    return "bf16" if params and all(p.dtype == torch.bfloat16 for p in params) else "fp32"


def check(label: str, group: dict) -> None:
    """The group's state options are names the daemons know, else ValueError
    naming the group (``label``), the key and the allowed names."""
    for key in KEYS:
        if key not in group:
            continue
        allowed = _wire_enums.state_options(key)
        if not isinstance(group[key], str) or group[key] not in allowed:
            raise ValueError(f"{label}: {key!r} must be one of {allowed}, got {group[key]!r}")
