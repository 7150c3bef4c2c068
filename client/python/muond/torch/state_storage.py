"""A group's optimizer-state options: ``state_dtype`` ("auto", "fp32", "bf16",
"fp8_e4m3") and ``state_location`` ("device", "host"), either algorithm's
(muond.torch.options StateStorageOptions; core/common/state_options.h). The
names are the wire enums' (muond.wire_enums), "auto" the unset dtype. They
are fixed at registration, but a state dict saved with other ones loads: the
daemons' import converts each value, rounding to this group's dtype."""
from __future__ import annotations

from muond import wire_enums as _wire_enums

KEYS = tuple(_wire_enums.STATE_ENUM_FIELDS)


def check(label: str, group: dict) -> None:
    """The group's state options are names the daemons know, else ValueError
    naming the group (``label``), the key and the allowed names."""
    for key in KEYS:
        if key not in group:
            continue
        allowed = _wire_enums.state_options(key)
        if not isinstance(group[key], str) or group[key] not in allowed:
            raise ValueError(f"{label}: {key!r} must be one of {allowed}, got {group[key]!r}")
