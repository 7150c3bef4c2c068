"""Whether a list of tensors still has the layout it was seen with: each
one's address, sizes, strides, dtype, device and requires_grad.

step() asks this of every registered param and grad at every step. A pass
in Python costs one call into each tensor per property (~0.1-0.3 µs each):
~0.4 ms a step for 388 params, ~15 ms for 10,000 (an MoE with per-expert
params). torch has the same test in C++ for its own guards (dynamo's
``TensorGuards``: sizes, strides, dtype, device, requires_grad; CUDA graph
trees' ``_tensors_data_ptrs_at_indices_equal``: the addresses); where this
torch has both and they pass a self-test at first use, one call each checks
the whole list. Otherwise (another torch, a changed private API) the Python
passes answer, with the same result.
"""
from __future__ import annotations

import functools
import operator

import torch

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride


class _PythonPasses:
    """The test as passes in Python (one per property), for any torch."""

    def __init__(self, tensors):
        self._ptrs = list(map(_DATA_PTR, tensors))
        self._shapes = list(map(_SHAPE, tensors))
        self._strides = list(map(_STRIDE, tensors))
        self._dtypes = list(map(_DTYPE, tensors))
        self._devices = list(map(_DEVICE, tensors))
        self._requires_grad = list(map(_REQUIRES_GRAD, tensors))

    def holds(self, tensors) -> bool:
        return (len(tensors) == len(self._ptrs)
                and list(map(_DATA_PTR, tensors)) == self._ptrs
                and list(map(_SHAPE, tensors)) == self._shapes
                and list(map(_STRIDE, tensors)) == self._strides
                and list(map(_DTYPE, tensors)) == self._dtypes
                and list(map(_DEVICE, tensors)) == self._devices
                and list(map(_REQUIRES_GRAD, tensors)) == self._requires_grad)


class _TorchGuards:
    """The test as two calls into torch's C++ guard code."""

    def __init__(self, tensors):
        from torch._C._dynamo.guards import TensorGuards  # private: see native_usable
        self._count = len(tensors)
        self._guards = TensorGuards(
            *tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors])
        self._ptrs = list(map(_DATA_PTR, tensors))
        self._indices = list(range(len(tensors)))

    def holds(self, tensors) -> bool:
        # A changed tensor count is no answer of the guards' (they raise).
        return (len(tensors) == self._count and self._guards.check(*tensors)
                and torch._C._tensors_data_ptrs_at_indices_equal(
                    tensors, self._ptrs, self._indices))


def _refuses_each_change(make) -> bool:
    """Whether ``make`` (a layout class) tells the tensors it was made with
    from each kind of change this module promises to see."""
    base = torch.zeros(64)
    seen = [base[0:12].view(3, 4), base[12:24].view(3, 4)]
    layout = make(seen)
    other = base[24:36].view(3, 4)
    changes = [
        [other, seen[1]],                                       # address
        [seen[0].view(4, 3), seen[1]],                          # sizes
        [seen[0].t().contiguous().t(), seen[1]],                # strides
        [seen[0].view(torch.int32), seen[1]],                   # dtype, same address
        [seen[0].detach().requires_grad_(), seen[1]],           # requires_grad
    ]
    return layout.holds(list(seen)) and not any(map(layout.holds, changes))


@functools.lru_cache(maxsize=None)
def native_usable() -> bool:
    """torch's guard code is here, takes what this module gives it and
    answers as the Python passes do on the self-test's changes (both are
    private APIs: a torch that moved or changed them falls back)."""
    try:
        return _refuses_each_change(_TorchGuards)
    except Exception:  # noqa: BLE001 (any failure of a private API: fall back)
        return False


class SameLayout:
    """The layout of ``tensors`` now; ``holds(tensors)`` says whether a list
    of the same length still has it, tensor by tensor."""

    def __init__(self, tensors):
        tensors = list(tensors)
        self._test = None
        if native_usable():
            try:
                self._test = _TorchGuards(tensors)
            except Exception:  # noqa: BLE001 (a tensor the guards refuse: a subclass)
                self._test = None
        if self._test is None:
            self._test = _PythonPasses(tensors)

    @property
    def native(self) -> bool:
        return isinstance(self._test, _TorchGuards)

    def holds(self, tensors) -> bool:
        """True: every tensor has its layout still. False: one changed, or
        the test could not tell (the caller then looks tensor by tensor)."""
        try:
            return self._test.holds(tensors)
        except Exception:  # noqa: BLE001 (the guards refused an argument)
            return False


class LayoutCache:
    """A caller's own per-property check of a list of tensors, answered first
    by the layout (``SameLayout``) the last passing check found.

    ``holds(tensors, passes)``: True where that layout still holds; else
    ``passes()`` (the caller's full check) answers, and a pass records the
    layout anew. SameLayout is stricter than most callers' passes (strides,
    requires_grad, the grad mode it was taken in), so it may fail where they
    pass. A layout failing at its first use twice running while the passes
    pass (requires_grad flipped at every step) would be taken again at every
    step, at ~6 checks' cost: the passes then answer alone until they fail
    (something did change)."""

    def __init__(self):
        self._layout = None
        self._fresh = False         # taken at the last call, not yet held once
        self._fresh_failures = 0    # fresh layouts failing in a row
        self._useful = True

    def holds(self, tensors, passes) -> bool:
        layout = self._layout
        if layout is not None and layout.holds(tensors):
            self._fresh, self._fresh_failures = False, 0
            return True
        if not passes():
            self._layout, self._fresh, self._fresh_failures = None, False, 0
            self._useful = True
            return False
        if layout is not None and self._fresh:
            self._fresh_failures += 1
            self._useful = self._fresh_failures < 2
        self._layout = SameLayout(tensors) if self._useful else None
        self._fresh = self._useful
        return True
