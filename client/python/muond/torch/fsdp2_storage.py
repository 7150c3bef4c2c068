"""FSDP2's sharded params stored in muond's shared param buffer: no copy per step.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each param's padded local
shard in a flat tensor of its own (``FSDPParam._sharded_param_data``), and the
param's DTensor local tensor is a view of it: the all-gather before forward
reads it, and an optimizer's update writes it. Pointing both at a span of
muond's param buffer lets the daemons update the params in place, as they do
for plain tensors, instead of muond holding a second copy of every shard and
copying it in and out at each step.

These are FSDP2's private attributes, so a param is bound only when they look
exactly as expected (a plain 1-D padded shard on the param's device, Shard(0),
no CPU offload, no tensor-subclass extension); any other param keeps the copy
path. FSDP2 re-points a param at new storage itself after ``load_state_dict(...,
assign=True)`` or ``model.to()``: ``BoundShard.intact`` notices, and
``bind_again`` takes the new values into the buffer. The grads stay FSDP2's
unless the trainer zeroes them with ``zero_grad(set_to_none=False)``: then the
param's grad is a DTensor over muond's grad span, which FSDP2's reduce-scatter
accumulates into (``grad_over``), and nothing is copied for it either.
"""
from __future__ import annotations

import math

import torch


def fsdp_params() -> dict:
    """id(sharded param) -> its FSDPParam, for every param FSDP2 manages in
    the bindable form (``_bindable``); {} where FSDP2 is absent."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return {}
    found = {}
    for ref in list(_module_state_mapping.values()):
        group = getattr(ref(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            param = getattr(fsdp_param, "sharded_param", None)
            if param is not None and _bindable(fsdp_param):
                found[id(param)] = fsdp_param
    return found


def _bindable(fsdp_param) -> bool:
    try:
        data = fsdp_param._sharded_param_data
        local = fsdp_param.sharded_param._local_tensor
        padded = tuple(fsdp_param.padded_sharded_param_size)
        info = fsdp_param._module_info  # where BoundShard hooks its loads
        hookable = (len(info.shared_modules) == len(info.shared_param_names)
                    and all(callable(getattr(m, "register_load_state_dict_pre_hook", None))
                            for m in [info.module, *info.shared_modules]))
        return (hookable and type(data) is torch.Tensor and type(local) is torch.Tensor
                and data.dim() == 1 and data.numel() == math.prod(padded)
                and data.is_contiguous() and local.is_contiguous()
                and not fsdp_param.offload_to_cpu
                and callable(getattr(fsdp_param, "to_sharded_dtensor", None))
                and fsdp_param.fsdp_placement.dim == 0
                and data.dtype == local.dtype and data.device == local.device
                and tuple(local.shape[1:]) == padded[1:]
                and (local.numel() == 0 or local.data_ptr() == data.data_ptr()))
    except (AttributeError, TypeError):
        return False


class BoundShard:
    """One FSDP2 param whose padded local shard lives in ``padded`` (a view of
    muond's param buffer, ``padded_sharded_param_size``): the param's local
    tensor is its first rows, FSDP2's flat shard all of it. ``grad_view`` is
    its span of muond's grad buffer (the local shard's shape)."""

    def __init__(self, fsdp_param, padded: torch.Tensor, grad_view: torch.Tensor):
        self.fsdp_param, self.padded, self.grad_view = fsdp_param, padded, grad_view
        self.param = fsdp_param.sharded_param  # the optimizer's Parameter object
        self._hooks = None  # bind's load_state_dict pre-hooks (_own_storage_for)
        self.rows = fsdp_param.sharded_param._local_tensor.shape[0]

    def replaced(self) -> bool:
        """FSDP2 holds another Parameter object for this param now
        (load_state_dict(assign=True) without swap_tensors puts new ones in
        the module, and FSDP2 follows them): the optimizer's param is no
        longer the model's, and its grads never come."""
        return self.fsdp_param.sharded_param is not self.param

    @torch.no_grad()
    def bind(self) -> None:
        """Copies FSDP2's current shard (padding included) into the span and
        points FSDP2 and the param at it."""
        fp = self.fsdp_param
        self.padded.copy_(fp._sharded_param_data.view(self.padded.shape))
        self._point_at(self.padded)
        if self._hooks is None:
            info = fp._module_info
            self._hooks = [module.register_load_state_dict_pre_hook(self._own_storage_for(name))
                           for module, name in zip([info.module, *info.shared_modules],
                                                   [info.param_name, *info.shared_param_names])]

    def _own_storage_for(self, param_name: str):
        """A load_state_dict pre-hook: a tensor assigned to the param
        (assign=True) that lives in muond's param buffer (another param's
        state_dict entry, a view of its span) is cloned first. Every span
        shares the buffer's one storage, and FSDP2 takes a loaded tensor of
        its flat shard's storage for its own shard: it would keep the flat
        shard (the old values, which its all-gather reads) and point only the
        param's local tensor at the loaded one."""
        def hook(module, state_dict, prefix, local_metadata, *_):
            key = prefix + param_name
            value = state_dict.get(key)
            if not local_metadata.get("assign_to_params_buffers") or value is None:
                return
            local = getattr(value, "_local_tensor", value)
            if (isinstance(local, torch.Tensor) and local.device == self.padded.device
                    and local.untyped_storage().data_ptr()
                    == self.padded.untyped_storage().data_ptr()):
                state_dict[key] = value.detach().clone()
        return hook

    def unhook(self) -> None:
        """The optimizer's end: its load_state_dict pre-hooks go."""
        for handle in self._hooks or ():
            handle.remove()
        self._hooks = None

    def intact(self) -> bool:
        """FSDP2 and the param still use the span (not new storage of
        FSDP2's own, after a load with assign=True or a move)."""
        fp = self.fsdp_param
        return (fp._sharded_param_data.data_ptr() == self.padded.data_ptr()
                and fp.sharded_param._local_tensor.data_ptr() == self.padded.data_ptr())

    def bind_again(self) -> str | None:
        """After FSDP2 re-pointed the param: its new values into the span and
        FSDP2 back on it; what changed (shape, dtype, device) when they cannot
        go there, else None."""
        fp = self.fsdp_param
        data = fp._sharded_param_data
        changed = [f"{what} {a} -> {b}" for what, a, b in (
            ("shard size", self.padded.numel(), data.numel()),
            ("dtype", self.padded.dtype, data.dtype),
            ("device", self.padded.device, data.device)) if a != b]
        if changed:
            return ", ".join(changed)
        self.bind()
        return None

    def grad_over(self, view: torch.Tensor | None = None):
        """A grad for the param whose local tensor is ``view`` (default the
        shared grad span): FSDP2's reduce-scatter then accumulates into it in
        place."""
        return self.fsdp_param.to_sharded_dtensor(self.grad_view if view is None else view)

    def grad_in_span(self, grad) -> bool:
        """``grad`` (the param's .grad) is the shared grad span: an attribute
        read per step, not DTensor.to_local's autograd call."""
        local = getattr(grad, "_local_tensor", None)
        return local is not None and local.data_ptr() == self.grad_view.data_ptr()

    @torch.no_grad()
    def release(self) -> None:
        """The optimizer's end: FSDP2 gets storage of its own again (a copy of
        the span), so the buffer can be freed."""
        if self.intact():
            self._point_at(self.padded.clone())

    def _point_at(self, padded: torch.Tensor) -> None:
        fp = self.fsdp_param
        fp._sharded_param_data = padded.view(-1)
        fp.sharded_param._local_tensor = padded.narrow(0, 0, self.rows)
