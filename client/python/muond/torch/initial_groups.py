"""The constructor's ``params`` as param groups: the Muon defaults from
torch.optim.Muon's arguments and muond's options, a plain iterable of params
split into a Muon and an AdamW group, and every AdamW group's betas and eps."""
from __future__ import annotations

import warnings

import torch

from muond.torch import groups


def muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                  adjust_lr_fn, o: dict) -> dict:
    """A Muon group's defaults from torch's parameters and the resolved flat
    options ``o`` (muond.torch.options.resolve)."""
    coefficient_type = o["coefficient_type"]
    if ns_coefficients is not None:
        if coefficient_type not in (None, "custom"):
            raise ValueError("give ns_coefficients or coefficient_type, not both")
        coefficient_type, custom = groups.coefficients_from_torch(ns_coefficients)
    else:
        custom = []
    scale_mode, extra_scale_factor = groups.scale_from_adjust_lr_fn(
        adjust_lr_fn, o["scale_mode"], o["extra_scale_factor"])
    gram_restarts = o["gram_restarts"]
    return dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                # torch.optim.Muon's own default (ns_coefficients=None) is the
                # "simple" triple (3.4445, -4.775, 2.0315): the drop-in keeps it.
                eps=eps, ns_steps=ns_steps, coefficient_type=coefficient_type or "simple",
                custom_coefficients=custom, scale_mode=scale_mode,
                extra_scale_factor=extra_scale_factor, ns_batch_size=o["ns_batch_size"],
                weight_decay_method=o["weight_decay_method"],
                fp32_matmul_prec=o["fp32_matmul_prec"], use_syrk=o["use_syrk"],
                ns_algorithm=o["ns_algorithm"],
                # A list copy of an iterable; anything else (None, a str, an
                # int) as given, so check_gram_options names it (ValueError).
                gram_restarts=(list(gram_restarts)
                               if hasattr(gram_restarts, "__iter__")
                               and not isinstance(gram_restarts, (str, bytes))
                               else gram_restarts),
                gram_dtype=o["gram_dtype"], gram_min_aspect_ratio=o["gram_min_aspect_ratio"],
                variant=o["variant"], beta2=o["beta2"], moment2_eps=o["moment2_eps"],
                # Every group's, AdamW groups' too (torch.optim fills them in).
                state_dtype=o["state_dtype"], state_location=o["state_location"],
                double_buffer_momentum=o["double_buffer_momentum"], algorithm="muon")


def with_adamw_options(params: list, defaults: dict, betas, adamw_eps) -> list:
    """``params`` with every AdamW group's own betas and eps (defaulted);
    ``defaults`` gets "betas" when every group is AdamW."""
    if not (params and isinstance(params[0], dict)):
        return params
    params = [dict(grp) for grp in params]
    for gi, grp in enumerate(params):
        if grp.get("algorithm", "muon") == "adamw":
            groups.check_adamw_options(gi, grp)
            groups.check_adamw_keys(gi, grp)
            grp.setdefault("betas", tuple(betas))
            grp.setdefault("eps", adamw_eps)
    if all(grp.get("algorithm", "muon") == "adamw" for grp in params):
        # LR schedulers that cycle momentum (OneCycleLR, CyclicLR) cycle
        # betas[0] when "betas" is in `defaults`, as for torch.optim.AdamW,
        # and "momentum" when it is not, as for torch.optim.Muon.
        defaults["betas"] = tuple(betas)
    return params


def split_plain_params(params: list) -> list:
    """A plain iterable of params, or of (name, param) pairs
    (``model.parameters()``, ``model.named_parameters()``), as param groups:
    the 2-D params in a Muon group and every other param (biases, norm
    weights, scalars, conv kernels) in an AdamW group, which takes the
    optimizer's lr and weight_decay as any group does. torch.optim.Muon
    refuses such params, and its users split them by hand into an AdamW
    optimizer (its docs, Moonlight's and Dion's examples); here the one-line
    construction of a whole model works. No warning for vectors and
    scalars: it is the documented rule; a param of more than two dims (an
    [E, m, n] expert tensor, which a Muon group steps as a batch of
    matrices, or a conv kernel) is warned about by name, since that choice
    is the user's. With no non-2-D param the iterable stays one Muon group; param
    groups (dicts) are the user's choice, kept as given (a non-2-D param in
    a Muon group is refused naming the fix: groups.check_param)."""
    if not params or isinstance(params[0], dict):
        return params
    tensors = [item[1] if isinstance(item, tuple) and len(item) == 2 else item
               for item in params]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return params  # torch.optim.Optimizer names what is no tensor
    matrices = [item for item, t in zip(params, tensors) if t.ndim == 2]
    others = [item for item, t in zip(params, tensors) if t.ndim != 2]
    if not others:
        return params
    _warn_batches_to_adamw(params, tensors)
    return ([{"params": matrices}] if matrices else []) + [
        {"params": others, "algorithm": "adamw"}]


def _warn_batches_to_adamw(params: list, tensors: list) -> None:
    """A warning naming the params of more than two dims the plain split
    gives to AdamW (experts would be Muon's in a Muon group)."""
    named = [item[0] if isinstance(item, tuple) else f"param{i}"
             for i, (item, t) in enumerate(zip(params, tensors)) if t.ndim > 2]
    if named:
        shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
        warnings.warn(
            f"muond.torch.Muon: {shown}: params of more than two dims go to the AdamW group of "
            "a plain params iterable (conv kernels and [E, m, n] experts alike); to step "
            "experts with Muon, as a batch of matrices, give param groups with them in a Muon "
            "group (client/python/README.md, 'Batches of matrices')", stacklevel=4)
