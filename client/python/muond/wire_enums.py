"""Option names <-> muond.v1 enum values, the one place the Python client maps them.

The wire names an option value by its enum's prefix followed by the core name in
upper case: ``scale_mode="shape_scaling"`` is ``SCALE_MODE_SHAPE_SCALING``,
``cost_model="measured"`` is ``COST_MODEL_MEASURED``. server/common/proto_convert
applies the same rule on the daemon's side (and the core parsers own the list of
names), so the user-facing string kwargs of muond.torch stay what they always were.
Value 0, ``*_UNSPECIFIED``, means "the daemon's default".
"""
from __future__ import annotations

from muond.v1 import muond_pb2 as pb

_UNSPECIFIED = "UNSPECIFIED"


def _prefix(enum) -> str:
    return enum.Name(0)[:-len(_UNSPECIFIED)]


def names(enum) -> list[str]:
    """The option names of `enum` (without UNSPECIFIED), e.g. ['spectral', ...]."""
    prefix = _prefix(enum)
    return [n[len(prefix):].lower() for n in enum.keys() if not n.endswith(_UNSPECIFIED)]


def to_wire(enum, field: str, name: str | None) -> int:
    """The enum value of option `name`; None or "" -> UNSPECIFIED (the default).
    ValueError naming `field` and the allowed names otherwise."""
    if not name:
        return 0
    # Exactly the core's names, as the daemon's parsers took them before the
    # wire carried enums: no other case, and not "unspecified".
    if name not in names(enum):
        raise ValueError(f"{field} {name!r} not in {names(enum)}")
    return enum.Value(_prefix(enum) + name.upper())


def from_wire(enum, value: int, default: str) -> str:
    """The option name of an enum value; UNSPECIFIED -> `default`."""
    if value == 0:
        return default
    return enum.Name(value)[len(_prefix(enum)):].lower()


# The MuonHyperparams fields that are enums: field -> its enum.
MUON_ENUM_FIELDS = {
    "weight_decay_method": pb.WeightDecayMethod,
    "coefficient_type": pb.CoefficientType,
    "scale_mode": pb.ScaleMode,
    "fp32_matmul_prec": pb.MatmulPrecision,
    "ns_algorithm": pb.NsAlgorithm,
    "gram_dtype": pb.NsIterDType,
    "variant": pb.MuonVariant,
}


# The optimizer-state options of either algorithm's hyperparameters. A
# state_dtype of "auto" is STATE_DTYPE_UNSPECIFIED: the daemon applies
# torch's rule (core/common/state_options.h AutoStateDType) to the params it
# holds. muond.torch sends it resolved over the whole group instead
# (muond.torch.state_storage.wire_dtype).
STATE_ENUM_FIELDS = {
    "state_dtype": pb.StateDType,
    "state_location": pb.StateLocation,
}
AUTO_STATE_DTYPE = "auto"


def state_options(field: str) -> list[str]:
    """The names a group's ``field`` (a STATE_ENUM_FIELDS key) may take."""
    auto = [AUTO_STATE_DTYPE] if field == "state_dtype" else []
    return auto + names(STATE_ENUM_FIELDS[field])


def state_to_wire(field: str, name: str) -> int:
    """A state option's enum value (state_dtype "auto" -> UNSPECIFIED).
    ValueError naming `field` and the allowed names otherwise."""
    if field == "state_dtype" and name == AUTO_STATE_DTYPE:
        return 0
    return to_wire(STATE_ENUM_FIELDS[field], field, name)
