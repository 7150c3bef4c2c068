"""The Muon variants' group options, checked before any daemon sees them.

A Muon group's ``variant`` renormalises the Newton-Schulz output with a
second moment before the Muon scale (the daemon's core/muon/muon_variant.h
has the rule):

* "muon": none (torch.optim.Muon's step).
* "normuon" (dion's NorMuon): per output row ``v <- lerp(v, mean_j O_ij^2,
  1 - beta2)``, ``O_ij <- O_ij / (sqrt(v_i) + moment2_eps)``, then O rescaled
  to its Frobenius norm before the division. State ``variance_neuron``.
* "adamuon" (Emerging-Optimizers' AdaMuon): elementwise
  ``v <- lerp(v, O*O, 1 - beta2)``, ``O <- O / (sqrt(v) + moment2_eps)``.
  State ``moment2_buffer``.

``variant``, ``beta2`` and ``moment2_eps`` are fixed at registration: the
Step's GroupOverride carries AdamW's beta2, which the daemon refuses for a
Muon group, so a change after construction is refused at step() like any
other fixed entry."""
from __future__ import annotations

import math

import numpy as np

from muond import _rules

# The variants' names, the daemon's (core/muon/muon_variant.h, through the
# generated muond._rules; tests/rules checks the wire enum's names alike).
VARIANTS = _rules.MUON_VARIANTS
KEYS = ("variant", "beta2", "moment2_eps")
# The largest finite fp32: moment2_eps is used as an fp32.
_FP32_MAX = 3.4028234663852886e38


def _number(value):
    """``value`` as a float when it is a real number (no bool, str, None),
    else None."""
    from muond.torch.groups import is_bool  # noqa: PLC0415 (groups imports this module)
    if value is None or isinstance(value, (str, bytes)) or is_bool(value):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def check(label: str, group: dict) -> None:
    """A Muon group's variant options, else ValueError naming group and key:
    ``variant`` one of VARIANTS, ``beta2`` a real in [0, 1), ``moment2_eps``
    a finite real > 0 (as fp32). Keys the group lacks take the defaults."""
    variant = group.get("variant", "muon")
    if variant not in VARIANTS:
        raise ValueError(f"{label}: 'variant' must be one of {list(VARIANTS)}, got {variant!r}")
    if "beta2" in group:
        beta2 = _number(group["beta2"])
        if beta2 is None or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"{label}: 'beta2' must be a real number in [0, 1), got "
                             f"{group['beta2']!r}")
    if "moment2_eps" in group:
        eps = _number(group["moment2_eps"])
        if eps is None or not (math.isfinite(eps) and 0.0 < eps <= _FP32_MAX
                               and np.float32(eps) > 0):
            raise ValueError(f"{label}: 'moment2_eps' must be a finite real number > 0 (as "
                             f"fp32), got {group['moment2_eps']!r}")
    # Plain Python values in the group (a numpy one would not load back with
    # torch.load(weights_only=True)).
    group["variant"] = str(variant)
    for key in ("beta2", "moment2_eps"):
        if key in group:
            group[key] = _number(group[key])
