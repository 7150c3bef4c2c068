"""A param group as the wire carries it: the registered hyperparameters
(ParamGroup), the live ones sent with every Step (GroupOverride), the dtypes
and a whole param's shape and strides."""
from __future__ import annotations

import operator

import torch

from muond import wire_enums as _wire_enums
from muond.torch import state_storage as _state_storage
from muond.v1 import muond_pb2 as pb

DTYPES = {torch.float32: pb.DTYPE_FP32, torch.bfloat16: pb.DTYPE_BF16,
          torch.float16: pb.DTYPE_FP16}


def override(wname: str, group: dict) -> pb.GroupOverride:
    """The group's live hyperparameters as they are now."""
    o = pb.GroupOverride(group=wname, lr=float(group["lr"]),
                         weight_decay=float(group["weight_decay"]))
    if group["algorithm"] == "adamw":
        beta1, beta2 = group["betas"]
        o.beta1, o.beta2, o.eps = float(beta1), float(beta2), float(group["eps"])
    else:
        o.momentum, o.nesterov = float(group["momentum"]), bool(group["nesterov"])
    return o


def set_hyperparams(wg: pb.ParamGroup, group: dict) -> None:
    """The group's registered hyperparameters on the wire group (raises
    TypeError/ValueError on a value the wire cannot carry)."""
    wg.algorithm = pb.ALGORITHM_ADAMW if group["algorithm"] == "adamw" else pb.ALGORITHM_MUON
    # Either algorithm's state dtype (concrete: "auto" resolved over the
    # whole group) and location (a group without it: the daemon's, device).
    state = {"state_dtype": _wire_enums.state_to_wire("state_dtype",
                                                      _state_storage.wire_dtype(group))}
    if group.get("state_location"):
        state["state_location"] = _wire_enums.state_to_wire("state_location",
                                                            group["state_location"])
    if group["algorithm"] == "adamw":
        beta1, beta2 = group["betas"]
        wg.adamw.CopyFrom(pb.AdamWHyperparams(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), **state))
        return
    # The string options (scale_mode="spectral", ...) become wire enums
    # here, in one place (muond.wire_enums).
    enums = {field: _wire_enums.to_wire(enum, field, group.get(field))
             for field, enum in _wire_enums.MUON_ENUM_FIELDS.items()}
    coefficients = group["custom_coefficients"]
    coefficients = () if coefficients is None else coefficients
    wg.muon.CopyFrom(pb.MuonHyperparams(
        lr=float(group["lr"]), momentum=float(group["momentum"]),
        nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
        # Converted here, as check_options took them: a numpy or tensor
        # scalar is no double or int to protobuf.
        custom_coefficients=[float(c) for c in coefficients],
        num_ns_steps=operator.index(group["ns_steps"]), eps=float(group["eps"]),
        extra_scale_factor=float(group["extra_scale_factor"]),
        ns_batch_size=operator.index(group["ns_batch_size"]), use_syrk=bool(group["use_syrk"]),
        double_buffer_momentum=bool(group.get("double_buffer_momentum", False)),
        **enums, **state))
    if group.get("gram_restarts") is not None:
        wg.muon.gram_restarts.CopyFrom(pb.GramRestarts(
            iterations=[operator.index(r) for r in group["gram_restarts"]]))
    if group.get("gram_min_aspect_ratio") is not None:
        wg.muon.gram_min_aspect_ratio = float(group["gram_min_aspect_ratio"])
    # The variant's second moment (fixed at registration: GroupOverride's
    # beta2 is AdamW's, which the daemon refuses for a Muon group).
    if group.get("beta2") is not None:
        wg.muon.beta2 = float(group["beta2"])
    if group.get("moment2_eps") is not None:
        wg.muon.moment2_eps = float(group["moment2_eps"])


def full_shape(shape) -> list:
    """A param's full shape on the wire, which knows matrices and vectors: a
    param of more than two dims or none (an AdamW param: elementwise; a 0-D
    scalar is [1]) as its flat length, as ``whole`` lays it out. The state
    keeps the param's own shape (muond.state: ParamInfo.shape)."""
    shape = [int(s) for s in shape]
    if 1 <= len(shape) <= 2:
        return shape
    n = 1
    for s in shape:
        n *= s
    return [n]


def whole(p: torch.Tensor):
    """Shape/strides of a whole param on the wire: 2-D as is, else flat 1-D."""
    if p.ndim == 2:
        return list(p.shape), [p.shape[1], 1]
    return [p.numel()], [1]


def matrices_of(skipped: list, matrices: dict) -> list:
    """Each daemon's skipped names on the wire: a batched param's name
    (``matrices``: name -> ((matrix wire name, daemon), ...)) as the names of
    its matrices that daemon holds."""
    return [[w for name in names
             for w in ([m for m, r in matrices[name] if r == rank]
                       if name in matrices else [name])]
            for rank, names in enumerate(skipped)]
