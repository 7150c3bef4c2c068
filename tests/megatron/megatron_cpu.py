"""Megatron-Core 0.19 on CPU under gloo, for tests: the few places where its
model and optimizer code names CUDA, redirected to the CPU.

* emerging-optimizers 0.3 imports ``typing.override`` (Python 3.12); this
  venv is 3.11: typing_extensions' is the same decorator.
* ``parallel_state``'s global memory buffer allocates on
  ``torch.cuda.current_device()``: a CPU buffer.
* The model-parallel RNG tracker forks CUDA RNG states: the CPU generator
  (the tests run without dropout, so no draw depends on it).
* ``torch.cuda.synchronize`` (dist_checkpointing's writer): nothing to wait for.
* ``Tensor.type()`` without arguments, which the mixed-precision wrapper
  and grad clipping compare with ``'torch.cuda.BFloat16Tensor'`` etc.: a CPU
  tensor answers with the CUDA name of its dtype.
* Factory calls with ``device='cuda'`` (the optimizer wrappers' scale and
  overflow tensors, grad-norm buffers) and ``torch.cuda.current_device()``:
  a TorchFunctionMode puts them on the CPU.
* The attention's default causal mask is built on CUDA: callers pass an
  explicit mask (``causal_mask``).

Nothing here changes arithmetic: every op runs as Megatron wrote it, on the
CPU.
"""
from __future__ import annotations

import contextlib
import typing

import torch
from torch.overrides import TorchFunctionMode

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

_FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.zeros_like, torch.empty_like, torch.ones_like}


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func in _FACTORIES and device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _CpuMemoryBuffer:
    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype)


class _CpuRngTracker:
    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        with torch.random.fork_rng(devices=[]):
            yield

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def add(self, name, seed):
        pass

    def reset(self):
        pass


_MODE = None
_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def install() -> None:
    """Call after ``parallel_state.initialize_model_parallel``."""
    global _MODE
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    tp_random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # no stream to wait for
    torch.Tensor.type = _cuda_type_name
    if _MODE is None:
        _MODE = _CudaToCpu()
        _MODE.__enter__()


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's boolean mask (True: masked) for a causal attention."""
    return torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
