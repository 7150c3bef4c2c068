"""``muond.torch.Muon``: a torch.optim.Optimizer whose step runs on muond daemons.

    from muond.torch import Muon
    opt = Muon([{"params": matrices},
                {"params": others, "algorithm": "adamw", "lr": 3e-3, "betas": (0.9, 0.95)}],
               lr=3e-3, daemons=["unix:///tmp/muond-job-0.sock", ...], job_id="job",
               gtp_size=2, tp_size=2)
    ...
    opt.zero_grad(); loss.backward(); opt.step()

The constructor mirrors ``torch.optim.Muon`` (lr, weight_decay, momentum, nesterov,
ns_coefficients, eps, ns_steps, adjust_lr_fn) plus muond's options; its
defaults are torch's, Newton-Schulz on bf16 operands included
(fp32_matmul_prec="medium"; "highest" runs it in fp32). Groups with
``"algorithm": "adamw"`` take AdamW (their own lr, betas, eps, weight_decay).

Memory. At construction every param is moved once into memory the daemons can
map, and the model's ``param.data`` is rebound to it (same Parameter objects):
CPU tensors into POSIX shared memory (muond.shm), CUDA tensors into a fresh
CUDA allocation shared by IPC handle. Each shm object and each CUDA
allocation is declared once to a daemon as a memory region, and every tensor
refers to its region by name + byte offset (docs/ARCHITECTURE.md "Memory
registration"). Each param also gets a grad buffer in
such memory; construction leaves ``.grad`` as it was (None on a fresh model,
as torch.optim). ``zero_grad(set_to_none=False)`` zeroes the shared grad and
points ``.grad`` at it, so backward accumulates there in place (no copy);
``zero_grad()`` (torch's default, set_to_none) sets ``.grad`` to None, so the
next backward allocates a new grad, which ``step()`` copies into the shared
grad (one batched copy) before re-pointing ``.grad`` to it. As in
torch.optim, a param whose ``.grad`` is None at ``step()``, or that does not
require grad, is skipped (StepRequest.skip_params).

Hyperparameters. The entries torch.optim.Muon / AdamW read at every step
(LIVE_KEYS: lr, weight_decay, momentum, nesterov; betas, eps for AdamW
groups) are sent with every Step; every other group entry is fixed when the
group is registered, and ``step()`` raises ValueError naming the group and
the key if it changed.

Modes (``shard_mode``):

* ``"split"`` (default; one trainer, ``len(daemons) == gtp_size * tp_size``):
  every Muon weight is sharded over the G x T daemons as strided views of one
  buffer (layout: muond.split). The daemon at flat rank ``g*T + t`` gets
  group ``<group>`` in domain ``domain_name`` with its (g, t). Weights that do
  not split, and every AdamW param, go *whole to exactly one daemon* (the
  least loaded by ns_cost resp. element count, deterministic), in a group
  ``<group>.solo-r<rank>`` whose domain is the 1x1
  domain ``solo-r<rank>`` of that daemon. Nothing is registered with two
  daemons, so no update is applied twice to the same memory.
* ``"local"`` (one trainer per daemon: torchrun ranks, Megatron ranks;
  ``len(daemons) == 1``; the default without ``daemons=``, which finds this
  rank's daemon from the environment, muond.placement.discover): each param's
  domain and coordinates come from muond.placement — DTensor params (FSDP2,
  TP, FSDP + TP, HSDP) from their mesh and placements, plain params under
  torch.distributed as DDP replicas, Megatron-tagged local shards
  (``tensor_model_parallel``, ``partition_dim``, ``is_gtp_weight_remat``,
  ``pad_length``, optionally ``full_shape``) in domain ``domain_name`` with
  (gtp_size, tp_size, g, t) and their DP replicas found from every rank's
  claims. Under torch.distributed every rank checks the others' placement
  before any RPC (the same ValueError on all). DTensor params are never
  rebound: their local shards are copied into the shared buffers before each
  Step and back after it.

Step contract: ``step()`` sends Step with the same step id to every daemon
concurrently and returns when all answered (params updated in place). CUDA:
the current device is synchronised before the RPC. ``last_timings`` holds
per-phase daemon times (max over daemons, µs), ``rpc_us`` (client wall time
of the concurrent RPCs) and ``overhead_us = rpc_us - total_us``.

State: the daemons hold it; ``state_dict`` / ``load_state_dict`` / ``state``
carry it in torch.optim's format (ExportState / ImportState; conversions and
checks in muond.state). ``add_param_group`` re-registers every group and
carries the state over. A param rebound after construction is followed when
the new tensor matches the registered one's shape, dtype and device, else
refused at step(). The optimizer does not pickle: save its state_dict.
"""
from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
import time
import logging
import uuid
import weakref

import grpc
import torch

from muond import placement as _placement
from muond import split as _split
from muond import state as _state
from muond import wire_enums as _wire_enums
from muond.client import (ALREADY_REGISTERED, OPERATOR_CLIENT_ID, PEER_GONE, Client,
                          MuondError, error_info)
from muond.shm import ShmBuffer
from muond.v1 import muond_pb2 as pb

_DTYPES = {torch.float32: pb.DTYPE_FP32, torch.bfloat16: pb.DTYPE_BF16}
_LOG = logging.getLogger("muond.torch")
_PHASES = ("momentum_us", "a2a_fwd_us", "ns_us", "a2a_bwd_us", "dp_share_us", "update_us", "total_us")


class _Regions:
    """The memory regions of one optimizer's buffers, one per distinct memory:
    an shm object, or a CUDA allocation. Small CUDA params share one
    caching-allocator block, hence one IPC handle and one region; torch tells
    each buffer only its own storage's offset and size in the block, so the
    region's byte_size is the largest end any of its buffers reaches (a safe
    lower bound of the allocation's size)."""

    def __init__(self):
        self._by_memory: dict = {}  # shm name | (device, handle) -> pb.MemoryRegion
        self._by_name: dict[str, pb.MemoryRegion] = {}

    def shm(self, buffer: ShmBuffer) -> str:
        region = pb.MemoryRegion(name=buffer.name, kind=pb.MEMORY_KIND_HOST_SHM, shm_name=buffer.name,
                                 byte_size=buffer.nbytes)
        return self._add(buffer.name, region).name

    def cuda(self, device: int, handle: bytes, end: int) -> str:
        """The region of the allocation behind `handle`, covering at least
        [0, end) bytes."""
        key = (device, handle)
        if key not in self._by_memory:
            self._add(key, pb.MemoryRegion(name=f"cuda{device}-{len(self._by_memory)}",
                                           kind=pb.MEMORY_KIND_CUDA_IPC, cuda_ipc_handle=handle,
                                           device=device))
        region = self._by_memory[key]
        region.byte_size = max(region.byte_size, end)
        return region.name

    def _add(self, key, region: pb.MemoryRegion) -> pb.MemoryRegion:
        self._by_memory[key] = region
        self._by_name[region.name] = region
        return region

    def used_by(self, groups) -> list[pb.MemoryRegion]:
        """The declarations of the regions `groups`' refs name, in first-use
        order (a daemon maps only the memory it is given views into)."""
        names = dict.fromkeys(ref.region for g in groups for prm in g.params
                              for ref in (prm.param, prm.grad))
        return [self._by_name[n] for n in names]


class _Buffer:
    """Memory one param (or its grad) lives in: a flat tensor plus the region
    a daemon reaches it through and the tensor's byte offset in it."""

    def __init__(self, job_id: str, numel: int, like: torch.Tensor, regions: _Regions):
        self.shm = None
        if like.is_cuda:
            self.flat = torch.zeros(numel, dtype=like.dtype, device=like.device)
            storage = self.flat.untyped_storage()
            # (device, handle, storage_bytes, storage_offset_bytes, ...): the handle is
            # the IPC handle of the allocation *base*; our storage starts at the offset.
            info = storage._share_cuda_()
            self.base_offset = int(info[3])
            self.region = regions.cuda(int(info[0]), _raw_cuda_ipc_handle(bytes(info[1])),
                                       self.base_offset + int(info[2]))
        elif like.device.type == "cpu":
            self.shm = ShmBuffer(job_id, numel, like.dtype)
            self.flat = self.shm.flat
            self.base_offset = 0
            self.region = regions.shm(self.shm)
        else:
            raise ValueError(f"muond handles cpu and cuda tensors, got {like.device}")

    def ref(self, offset: int, shape, strides) -> pb.TensorRef:
        itemsize = self.flat.element_size()
        return pb.TensorRef(region=self.region, byte_offset=self.base_offset + offset * itemsize,
                            dtype=_DTYPES[self.flat.dtype], shape=list(shape),
                            strides=list(strides))

    def release(self) -> None:
        if self.shm is not None:
            self.shm.unlink()


CUDA_IPC_HANDLE_SIZE = 64


def _raw_cuda_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t the wire wants, from torch's shareable
    handle. torch >= 2.2 (c10 CUDACachingAllocator::shareIpcHandle) writes
    [version byte][type byte][payload]: type 'c' = cudaMalloc block, payload the
    cudaIpcMemHandle_t of the allocation base; 'e' = expandable segment (a
    different payload that cudaIpcOpenMemHandle cannot open). Older torch
    returned the raw 64 bytes."""
    if len(handle) == CUDA_IPC_HANDLE_SIZE:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_SIZE + 2 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ValueError("CUDA tensors from expandable segments cannot be shared by "
                         "cudaIpcMemHandle; run the trainer with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise ValueError(f"unrecognised torch CUDA IPC handle ({len(handle)} bytes)")


def _scale_from_adjust_lr_fn(adjust_lr_fn, scale_mode, extra_scale_factor):
    """torch.optim.Muon's adjust_lr_fn as muond's scale mode:
    None/"original": lr * sqrt(max(1, A/B)) = "shape_scaling" x 1;
    "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)) = "spectral" x 0.2.
    An explicit scale_mode / extra_scale_factor wins."""
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} not in (None, 'original', "
                         "'match_rms_adamw')")
    mode, extra = (("spectral", 0.2) if adjust_lr_fn == "match_rms_adamw"
                   else ("shape_scaling", 1.0))
    return (scale_mode or mode,
            extra if extra_scale_factor is None else float(extra_scale_factor))


# The param_groups entries torch.optim.Muon / torch.optim.AdamW read at every
# step: they travel in every Step as a GroupOverride (_override). Every other
# entry of a group is fixed at registration (the daemons build their engine
# from it) and a change is refused at step() (_check_fixed).
LIVE_KEYS = {"muon": ("lr", "weight_decay", "momentum", "nesterov"),
             "adamw": ("lr", "weight_decay", "betas", "eps")}
# Group entries that name params, not hyperparameters.
_PARAM_KEYS = ("params", "param_names")

# torch.optim.AdamW options an "adamw" group may carry: the value muond
# computes with (anything else is refused at construction). foreach and fused
# choose torch's kernels, not the math: accepted, ignored (the daemon has its
# own kernels).
_ADAMW_FIXED_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False,
                        "differentiable": False, "decoupled_weight_decay": True}


# Their AdamW keys that choose torch's kernels, not the math: carried in the
# groups (a state dict round-trips through torch.optim.AdamW), never fixed.
_KERNEL_KEYS = ("foreach", "fused")
# torch.optim.Muon's default ns_coefficients: muond's coefficient_type "simple".
_SIMPLE_COEFFICIENTS = (3.4445, -4.775, 2.0315)


def _from_torch_keys(group: dict) -> dict:
    """A user's Muon group dict with torch.optim.Muon's per-group
    ns_coefficients / adjust_lr_fn (and not muond's own coefficient_type /
    scale_mode): those as muond's options, so the group computes with them."""
    if group.get("algorithm", "muon") != "muon":
        return group
    group = dict(group)
    if "ns_coefficients" in group and "coefficient_type" not in group:
        group["coefficient_type"], group["custom_coefficients"] = _custom(group["ns_coefficients"])
    if "adjust_lr_fn" in group and "scale_mode" not in group:
        group["scale_mode"], group["extra_scale_factor"] = _scale_from_adjust_lr_fn(
            group["adjust_lr_fn"], None, None)
    return group


def _custom(ns_coefficients):
    flat = list(ns_coefficients)
    return "custom", [float(c) for c in (sum(map(list, flat), []) if flat and
                                         isinstance(flat[0], (tuple, list)) else flat)]


def _with_torch_keys(group: dict) -> None:
    """Gives a group the keys torch.optim.Muon / torch.optim.AdamW read, with
    the values muond computes with, so that its state dict loads into them
    (and theirs into muond: _loaded_options compares them)."""
    if group["algorithm"] == "adamw":
        for key, value in {**_ADAMW_FIXED_OPTIONS, "foreach": None, "fused": None}.items():
            group.setdefault(key, value)
        return
    if group["coefficient_type"] == "simple":
        group["ns_coefficients"] = _SIMPLE_COEFFICIENTS
    elif group["coefficient_type"] == "custom":
        c = [float(x) for x in group["custom_coefficients"]]
        triples = tuple(tuple(c[i:i + 3]) for i in range(0, len(c), 3))
        group["ns_coefficients"] = triples[0] if len(triples) == 1 else triples
    else:  # a per-iteration set torch has no triple for: its name
        group["ns_coefficients"] = group["coefficient_type"]
    scale = (group["scale_mode"], float(group["extra_scale_factor"]))
    if scale == ("shape_scaling", 1.0):
        given = group.get("adjust_lr_fn")
        group["adjust_lr_fn"] = given if given in (None, "original") else None
    elif scale == ("spectral", 0.2):
        group["adjust_lr_fn"] = "match_rms_adamw"
    else:  # no torch equivalent: says so (torch would scale by 1.0)
        group["adjust_lr_fn"] = f"muond:{scale[0]}x{scale[1]}"


def _check_adamw_options(gi: int, group: dict) -> None:
    for key, supported in _ADAMW_FIXED_OPTIONS.items():
        if key in group and bool(group[key]) != supported:
            raise ValueError(f"param group {gi}: AdamW option {key}={group[key]!r} is not "
                             f"supported by muond (only {key}={supported})")


def _frozen(value):
    """A comparable copy of a group entry (tensors and lists compared by value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value):
    """A _frozen entry as the user wrote it, for messages (lists, not tuples)."""
    if isinstance(value, tuple) and value[:1] == ("tensor",) and len(value) == 2:
        return list(value[1])
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


def _fixed_entries(group: dict) -> dict:
    live = LIVE_KEYS[group["algorithm"]]
    return {k: _frozen(v) for k, v in group.items()
            if k not in live and k not in _PARAM_KEYS and k not in _KERNEL_KEYS}


def _group_label(gi: int, group: dict) -> str:
    return f"param group {gi} ({group.get('name', f'group{gi}')!r})"


def _real(label: str, key: str, value) -> float:
    """A live hyperparameter as the float the wire carries: a real number
    (int, float, numpy scalar, one-element tensor; not bool, None or str) and
    finite, else ValueError naming group and key. Its bounds (momentum < 1,
    ...) are the daemon's (core/muon/bounds.h): step() names them."""
    ok = not isinstance(value, (bool, str, bytes)) and value is not None
    if isinstance(value, torch.Tensor):
        ok = value.numel() == 1 and (value.is_floating_point() or not value.is_complex())
    try:
        number = float(value) if ok else None
    except (TypeError, ValueError, RuntimeError):
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{label}: {key!r} must be a finite real number, got {value!r}")
    return number


def check_live(gi: int, group: dict) -> None:
    """The group's live entries (LIVE_KEYS) convert to what Step carries, or
    ValueError naming group and key (nothing sent)."""
    label = _group_label(gi, group)
    for key in LIVE_KEYS[group["algorithm"]]:
        if key not in group:
            continue
        value = group[key]
        if key == "betas":
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
                raise ValueError(f"{label}: 'betas' must be a pair of numbers, got {value!r}")
            for v in value:
                _real(label, key, v)
        elif key == "nesterov":
            if not isinstance(value, (bool, int)) or value not in (0, 1):
                raise ValueError(f"{label}: 'nesterov' must be a bool, got {value!r}")
        else:
            _real(label, key, value)


# The step ids a daemon's ImportState accepts, [-1,
# DaemonCore::kMaxRestoredStepId = kMaxStepId - 1] (server/daemon/daemon_core.h,
# the rule's home; the next step id must stay valid): checked here too so that a
# bad state dict is a ValueError naming the key before any RPC, not a
# protobuf range error half way through the import.
MAX_STEP_ID = 2**62 - 1


def check_step_id(value) -> int:
    """A state dict's muond_step_id as an int in [-1, MAX_STEP_ID], else
    ValueError naming the key (a whole float is accepted: json/yaml loaders)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
    if not whole or not -1 <= int(value) <= MAX_STEP_ID:
        raise ValueError(f"state dict: {_state.STEP_ID_KEY!r} must be an int in "
                         f"[-1, {MAX_STEP_ID}], got {value!r}")
    return int(value)


class AddParamGroupError(RuntimeError):
    """add_param_group failed and registering the old groups again failed
    too: the optimizer is closed and unregistered from every daemon it
    reached. ``state_dict`` is the optimizer's state before the call, in
    torch.optim's format: resume with a new muond.torch.Muon (the old groups)
    and ``load_state_dict(error.state_dict)``."""

    def __init__(self, message: str, state_dict: dict):
        super().__init__(message)
        self.state_dict = state_dict


def _override(wname: str, group: dict) -> pb.GroupOverride:
    """The group's live hyperparameters as they are now."""
    o = pb.GroupOverride(group=wname, lr=float(group["lr"]),
                         weight_decay=float(group["weight_decay"]))
    if group["algorithm"] == "adamw":
        beta1, beta2 = group["betas"]
        o.beta1, o.beta2, o.eps = float(beta1), float(beta2), float(group["eps"])
    else:
        o.momentum, o.nesterov = float(group["momentum"]), bool(group["nesterov"])
    return o


def check_gram_options(gi: int, group: dict) -> None:
    """A Muon group's Gram Newton-Schulz options (ns_algorithm, gram_restarts,
    gram_dtype, gram_min_aspect_ratio: fixed at registration) are what the
    daemon accepts, else ValueError naming group and key before any RPC. The
    rules' home is the daemon's ValidateGramOptions
    (core/muon/newton_schulz.cc); they are repeated here so that a typo
    fails at construction, not at registration."""
    label = _group_label(gi, group)
    for key, enum in (("ns_algorithm", pb.NsAlgorithm), ("gram_dtype", pb.NsIterDType)):
        allowed = _wire_enums.names(enum)
        if group.get(key) not in allowed:
            raise ValueError(f"{label}: {key!r} must be one of {allowed}, got {group.get(key)!r}")
    restarts = group.get("gram_restarts")
    if restarts is not None:
        steps = group.get("ns_steps", 5)
        if isinstance(restarts, (str, bytes)) or not hasattr(restarts, "__iter__"):
            raise ValueError(f"{label}: 'gram_restarts' must be None or a list of ints, "
                             f"got {restarts!r}")
        given, restarts = list(restarts), []
        for i, r in enumerate(given):
            # Integer-likes (numpy ints) count as ints; bool and float do not.
            try:
                value = None if isinstance(r, bool) else operator.index(r)
            except TypeError:
                value = None
            if value is None or not 1 <= value < steps:
                raise ValueError(f"{label}: 'gram_restarts' entries must be ints in "
                                 f"[1, ns_steps={steps}), got {r!r}")
            restarts.append(value)
            if i and value <= restarts[i - 1]:
                raise ValueError(f"{label}: 'gram_restarts' must be ascending and distinct, "
                                 f"got {given!r}")
    ratio = group.get("gram_min_aspect_ratio")
    if ratio is not None:
        ok = not isinstance(ratio, (bool, str, bytes))
        try:
            value = float(ratio) if ok else None
        except (TypeError, ValueError):
            value = None
        if value is None or not (value == 0.0 or (math.isfinite(value) and value >= 1.0)):
            raise ValueError(f"{label}: 'gram_min_aspect_ratio' must be None, 0 (the default) "
                             f"or a finite number >= 1, got {ratio!r}")


def _set_hyperparams(wg: pb.ParamGroup, group: dict) -> None:
    """The group's registered hyperparameters on the wire group (raises
    TypeError/ValueError on a value the wire cannot carry)."""
    wg.algorithm = pb.ALGORITHM_ADAMW if group["algorithm"] == "adamw" else pb.ALGORITHM_MUON
    if group["algorithm"] == "adamw":
        beta1, beta2 = group["betas"]
        wg.adamw.CopyFrom(pb.AdamWHyperparams(
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"])))
        return
    # The string options (scale_mode="spectral", ...) become wire enums
    # here, in one place (muond.wire_enums).
    enums = {field: _wire_enums.to_wire(enum, field, group[field])
             for field, enum in _wire_enums.MUON_ENUM_FIELDS.items()}
    wg.muon.CopyFrom(pb.MuonHyperparams(
        lr=float(group["lr"]), momentum=float(group["momentum"]),
        nesterov=bool(group["nesterov"]), weight_decay=float(group["weight_decay"]),
        custom_coefficients=group["custom_coefficients"],
        num_ns_steps=group["ns_steps"], eps=group["eps"],
        extra_scale_factor=group["extra_scale_factor"],
        ns_batch_size=group["ns_batch_size"], use_syrk=group["use_syrk"],
        **enums))
    if group.get("gram_restarts") is not None:
        wg.muon.gram_restarts.CopyFrom(pb.GramRestarts(
            iterations=[operator.index(r) for r in group["gram_restarts"]]))
    if group.get("gram_min_aspect_ratio") is not None:
        wg.muon.gram_min_aspect_ratio = float(group["gram_min_aspect_ratio"])


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_coefficients=None,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 coefficient_type: str | None = None, scale_mode: str | None = None,
                 extra_scale_factor: float | None = None, ns_batch_size: int = 1,
                 weight_decay_method: str = "decoupled", fp32_matmul_prec: str = "medium",
                 use_syrk: bool = False, ns_algorithm: str = "standard",
                 gram_restarts=None, gram_dtype: str = "fp16",
                 gram_min_aspect_ratio: float | None = None,
                 betas=(0.9, 0.95), adamw_eps: float = 1e-8,
                 daemons=(), job_id: str | None = None, gtp_size: int = 1, tp_size: int = 1,
                 shard_mode: str | None = None, g: int = 0, t: int = 0,
                 domain_name: str = "dense", dp_size: int | None = None,
                 dp_rank: int | None = None,
                 client_id: str | None = None, wait_healthy_timeout: float = 30.0,
                 rpc_timeout: float | None = 300.0, first_step_id: int = 1,
                 token: str | None = None, token_file=None, tls_root_certificates=None,
                 takeover: bool = False):
        if ns_coefficients is not None:
            if coefficient_type not in (None, "custom"):
                raise ValueError("give ns_coefficients or coefficient_type, not both")
            coefficient_type, custom = _custom(ns_coefficients)
        else:
            custom = []
        scale_mode, extra_scale_factor = _scale_from_adjust_lr_fn(
            adjust_lr_fn, scale_mode, extra_scale_factor)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        # torch.optim.Muon's own default (ns_coefficients=None) is the
                        # "simple" triple (3.4445, -4.775, 2.0315): the drop-in keeps it.
                        eps=eps, ns_steps=ns_steps, coefficient_type=coefficient_type or "simple",
                        custom_coefficients=custom, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, ns_batch_size=ns_batch_size,
                        weight_decay_method=weight_decay_method,
                        fp32_matmul_prec=fp32_matmul_prec, use_syrk=use_syrk,
                        ns_algorithm=ns_algorithm,
                        # A list copy of an iterable; anything else (None, a str, an
                        # int) as given, so check_gram_options names it (ValueError).
                        gram_restarts=(list(gram_restarts)
                                       if hasattr(gram_restarts, "__iter__")
                                       and not isinstance(gram_restarts, (str, bytes))
                                       else gram_restarts),
                        gram_dtype=gram_dtype, gram_min_aspect_ratio=gram_min_aspect_ratio,
                        algorithm="muon")
        params = list(params)
        if params and isinstance(params[0], dict):  # AdamW groups: their own betas, eps
            params = [dict(grp) for grp in params]
            for gi, grp in enumerate(params):
                if grp.get("algorithm", "muon") == "adamw":
                    _check_adamw_options(gi, grp)
                    grp.setdefault("betas", tuple(betas))
                    grp.setdefault("eps", adamw_eps)
            if all(grp.get("algorithm", "muon") == "adamw" for grp in params):
                # LR schedulers that cycle momentum (OneCycleLR, CyclicLR) cycle
                # betas[0] when "betas" is in `defaults`, as for torch.optim.AdamW,
                # and "momentum" when it is not, as for torch.optim.Muon.
                defaults["betas"] = tuple(betas)
        super().__init__(params, defaults)
        for gi, grp in enumerate(self.param_groups):
            if grp["algorithm"] == "muon":
                check_gram_options(gi, grp)
        self.state = _LazyState(self)  # the daemons hold it; see _LazyState
        self._views: list = []  # (param, the shared-buffer tensor it is bound to, its address)

        daemons = [daemons] if isinstance(daemons, str) else list(daemons)
        self._rank, self._world = _process_rank()
        no_daemon = None  # why this rank's discovered daemon cannot be there
        if not daemons:  # torchrun/srun: this rank's own daemon (muond.placement.discover)
            found = _placement.discover(job_id)
            no_daemon = found.missing_socket()
            daemons, job_id = [found.address], found.job_id
            if token is None and token_file is None:
                token_file = found.token_file
            if found.rank is not None and self._world <= 1:
                self._rank = found.rank
            shard_mode = shard_mode or "local"
        job_id = job_id if job_id is not None else "default"
        shard_mode = shard_mode or "split"
        if shard_mode not in ("split", "local"):
            raise ValueError(f"shard_mode {shard_mode!r} not in ('split', 'local')")
        if shard_mode == "split" and len(daemons) != gtp_size * tp_size:
            raise ValueError(f"split mode needs gtp_size x tp_size = {gtp_size} x {tp_size} "
                             f"daemons, got {len(daemons)}")
        if shard_mode == "local" and len(daemons) != 1:
            raise ValueError(f"local mode talks to one daemon, got {len(daemons)}")
        self.job_id, self.shard_mode, self.domain_name = job_id, shard_mode, domain_name
        self.gtp_size, self.tp_size, self.g, self.t = int(gtp_size), int(tp_size), int(g), int(t)
        self._dp = (dp_size, dp_rank)
        self.places: dict[str, _placement.ParamPlace] = {}  # local mode: param name -> place
        # DTensor params (never rebound: FSDP2 owns their storage): (param,
        # shared param view, shared grad view), copied in before and out after
        # every step.
        self._dtensors: list = []
        self.client_id = client_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.step_id = int(first_step_id) - 1
        self.last_timings: dict[str, float] = {}
        self.layouts: dict[str, object] = {}   # param name -> SplitLayout | ("solo", rank) | "local"
        self._buffers: list[_Buffer] = []
        self._regions = _Regions()
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._param_names: dict[int, str] = {}  # id(param) -> its wire name
        self._ranks_of: dict[str, tuple[int, ...]] = {}  # wire name -> daemons holding it
        self._fixed: dict[int, dict] = {}  # group index -> its entries fixed at registration
        # rank -> [(param group index, wire group name)] registered with that daemon
        self._wire_groups: dict[int, list[tuple[int, str]]] = {}
        self._closed = False
        self._adamw_eps, self._wait_healthy_timeout = adamw_eps, wait_healthy_timeout
        self.clients = [Client(a, timeout=rpc_timeout, token=token, token_file=token_file,
                               root_certificates=tls_root_certificates) for a in daemons]
        # Runs at close(), when the optimizer is collected, and at interpreter
        # exit (also after an uncaught exception): unregisters from every
        # daemon, else a new trainer on them is refused ALREADY_REGISTERED.
        # It holds the clients and ids, never the optimizer.
        self._finalizer = weakref.finalize(self, _finalize, self._buffers, self.clients,
                                           job_id, self.client_id, os.getpid())
        try:
            try:
                if no_daemon is not None:
                    # No socket: waiting cannot help (a forgotten $MUOND_JOB_ID).
                    # Given daemons= are waited for: a launcher may start them now.
                    raise FileNotFoundError(no_daemon)
                for c in self.clients:
                    c.wait_healthy(wait_healthy_timeout)
                unhealthy = None
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                unhealthy = e
            if unhealthy is not None and not self._collective():
                raise unhealthy
            # In a distributed local-mode job a daemon that is not healthy on
            # one rank is that rank's refusal in the placement agreement: every
            # rank raises it instead of waiting in a collective.
            per_rank = self._place_params(unhealthy)
            try:
                self._register_taking_over_stale(per_rank, takeover)
                refused = None
            except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
                refused = e
            # A daemon that refuses this rank's registration never publishes
            # its manifest, so its peers would wait for a plan until their
            # timeout: in a distributed job every rank raises the refusal.
            if self._collective():
                _agree_registered(refused, self._rank)
            elif refused is not None:
                raise refused
            for c in self.clients:
                c.wait_healthy(wait_healthy_timeout, need_plan=True)
            # The daemons read the shared grad buffers, which never move.
            self._on_cuda = self._any_cuda()
            self._registered = True
        except BaseException:
            # Leave nothing registered (the finalizer unregisters this client
            # id everywhere): otherwise the daemons refuse every later trainer.
            self._finalizer()
            raise

    # -- registration ------------------------------------------------------
    def _register_all(self, per_rank) -> list:
        """RegisterParams on every daemon concurrently; per daemon its
        response or its MuondError (all answers awaited: the refusals name
        each daemon's holder)."""
        futures = [c.register_future(self.job_id, per_rank[r], self.client_id,
                                     regions=self._regions.used_by(per_rank[r]))
                   for r, c in enumerate(self.clients)]
        out = []
        for f, c in zip(futures, self.clients):
            try:
                out.append(_result(f.result, c, "RegisterParams"))
            except MuondError as e:
                out.append(e)
        return out

    def _register_taking_over_stale(self, per_rank, takeover: bool) -> None:
        """Registers with every daemon. A daemon held by another client
        (ALREADY_REGISTERED: a trainer that ended without close(), or one
        still running) is cleared as the operator and registered again only
        when ``takeover`` is set or every holder is a client id of this host
        whose process is gone (muond.torch's default ids); a live holder is
        never taken over by default."""
        answers = self._register_all(per_rank)
        errors = [e for e in answers if isinstance(e, MuondError)]
        if not errors:
            return
        held = {self.clients[r].address: e.metadata.get("client_id", "")
                for r, e in enumerate(answers)
                if isinstance(e, MuondError) and e.reason == ALREADY_REGISTERED}
        if len(held) < len(errors):
            raise next(e for e in errors if e.reason != ALREADY_REGISTERED)
        live = {a: h for a, h in held.items() if not _is_stale_local_client(h)}
        if live and not takeover:
            raise MuondError(
                "muond.torch.Muon: the daemons hold another trainer's params ("
                + ", ".join(f"{a}: client {h!r}" for a, h in live.items())
                + "). If that trainer is gone (crashed, killed, preempted), pass "
                "takeover=True to clear its registration; otherwise stop it (or close() "
                "its optimizer) first", code=errors[0].code, reason=ALREADY_REGISTERED,
                metadata={"client_id": next(iter(live.values()))})
        _LOG.warning("muond.torch.Muon: taking over the daemons from client(s) %s (%s); "
                     "registering %r", sorted(set(held.values())),
                     "takeover=True" if live else "their process on this host is gone",
                     self.client_id)
        # As the operator: clears the stale holders and our own partial
        # registrations alike, then every daemon is registered afresh.
        self._on_all(lambda c: c.unregister(self.job_id, OPERATOR_CLIENT_ID),
                     "UnregisterParams (operator)")
        _gather([c.register_future(self.job_id, per_rank[r], self.client_id,
                                   regions=self._regions.used_by(per_rank[r]))
                 for r, c in enumerate(self.clients)], self.clients, "RegisterParams")

    # -- placement ---------------------------------------------------------
    def _collective(self) -> bool:
        """Placement is agreed with the other ranks (local mode under
        torch.distributed with world > 1)."""
        return self.shard_mode == "local" and self._world > 1

    def _place_params(self, refusal: BaseException | None = None) -> list[list[pb.ParamGroup]]:
        """Every param's wire group per daemon. In a collective placement
        (_collective) everything that may refuse, including ``refusal``, runs
        inside muond.placement.settle, so one rank's refusal stops all."""
        if self._collective():
            todo = []

            def compute():
                if refusal is not None:
                    raise refusal
                todo.extend(self._collect_params())
                return self._compute_places(todo)

            self.places = _placement.settle(compute, self._rank, self._world,
                                            _all_gather_object, dp_given=self._dp[0] is not None)
            return self._register_local(todo)
        todo = self._collect_params()
        if self.shard_mode == "local":
            self.places = self._compute_places(todo)
            return self._register_local(todo)
        return self._place_split_all(todo)

    def _register_local(self, todo) -> list[list[pb.ParamGroup]]:
        wire: list[dict[str, pb.ParamGroup]] = [dict()]
        for gi, gname, group, name, p in todo:
            self._place_local(gi, gname, group, name, p, wire)
        return [list(w.values()) for w in wire]

    def _collect_params(self) -> list:
        """(group index, group name, group, param name, param) of every
        param, checked (algorithm, names, dtype, Muon params 2-D)."""
        seen = set()
        # The live entries each group is registered with: as last registered
        # for a group the daemons accepted (param_groups may hold a value the
        # daemons refuse since, e.g. momentum=1.0: step() names that, and
        # add_param_group must not fail on it), else the group's own.
        self._placed_live = {}
        todo = []  # (gi, gname, group, name, p)
        for gi, group in enumerate(self.param_groups):
            algorithm = group["algorithm"]
            if algorithm not in ("muon", "adamw"):
                raise ValueError(f"param group {gi}: algorithm {algorithm!r} not in "
                                 "('muon', 'adamw')")
            registered = getattr(self, "_registered_live", {}).get(gi)
            self._placed_live[gi] = (dict(registered) if registered is not None else
                                     {k: group[k] for k in LIVE_KEYS[algorithm] if k in group})
            gname = group.get("name", f"group{gi}")
            names = group.get("param_names") or [f"{gname}.param{j}"
                                                  for j in range(len(group["params"]))]
            self._fixed[gi] = _fixed_entries(group)
            for name, p in zip(names, group["params"]):
                if name in seen:
                    raise ValueError(f"param name {name!r} appears twice")
                seen.add(name)
                self._param_names[id(p)] = name
                if p.dtype not in _DTYPES:
                    raise ValueError(f"param {name}: dtype {p.dtype} not in (float32, bfloat16)")
                if algorithm == "muon" and p.ndim != 2:
                    raise ValueError(f"param {name}: Muon params must be 2-D, got shape "
                                     f"{tuple(p.shape)}; put it in an algorithm='adamw' group")
                todo.append((gi, gname, group, name, p))
        return todo

    def _place_split_all(self, todo) -> list[list[pb.ParamGroup]]:
        n = len(self.clients)
        wire: list[dict[str, pb.ParamGroup]] = [dict() for _ in range(n)]
        muon_load, adamw_load = [0] * n, [0] * n
        for gi, gname, group, name, p in todo:
            algorithm = group["algorithm"]
            if _placement.is_dtensor(p):
                raise ValueError(f"param {name} is a DTensor: split mode shards full weights "
                                 "of one trainer; DTensor params (FSDP2, TP) need "
                                 "shard_mode='local' (the default without daemons=)")
            layout = None
            if algorithm == "muon":
                preferred = (int(getattr(p, "partition_dim", 0))
                             if getattr(p, "tensor_model_parallel", False) else None)
                layout = _split.plan_split(tuple(p.shape), self.gtp_size, self.tp_size,
                                           preferred)
            if layout is not None:
                self._place_split(gi, gname, group, name, p, layout, wire)
            else:
                load = muon_load if algorithm == "muon" else adamw_load
                rank = min(range(n), key=lambda r: (load[r], r))
                load[rank] += (_split.ns_cost(tuple(p.shape)) if algorithm == "muon"
                               else p.numel())
                self._place_solo(gi, gname, group, name, p, rank, wire)
        return [list(w.values()) for w in wire]

    def _wire_group(self, wire, rank, gi, wname, group, domain) -> pb.ParamGroup:
        if wname not in wire[rank]:
            wg = pb.ParamGroup(name=wname, domain=domain)
            _set_hyperparams(wg, {**group, **self._placed_live[gi]})
            wire[rank][wname] = wg
            self._wire_groups.setdefault(rank, []).append((gi, wname))
        return wire[rank][wname]

    def _rebind(self, p: torch.nn.Parameter, numel: int):
        """Moves p into a daemon-visible buffer of `numel` elements (the
        model's tensor is the contiguous prefix) and makes its shared grad
        buffer. ``.grad`` stays as the user had it, as with torch.optim (None
        for a fresh model: a param the first backward does not reach is
        skipped, not stepped on a zero grad); step() copies a grad that is not
        in the shared buffer there and re-points ``.grad`` to it, and
        ``zero_grad(set_to_none=False)`` binds it at once (zero-copy)."""
        pbuf = _Buffer(self.job_id, numel, p, self._regions)
        gbuf = _Buffer(self.job_id, numel, p, self._regions)
        self._buffers += [pbuf, gbuf]
        with torch.no_grad():
            view = pbuf.flat[:p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            self._views.append((p, view, view.data_ptr()))
            grad = gbuf.flat[:p.numel()].view(p.shape)
        self._grads.append((p, grad))
        return pbuf, gbuf

    def _place_split(self, gi, gname, group, name, p, layout, wire):
        pbuf, gbuf = self._rebind(p, layout.buffer_numel)
        self.layouts[name] = layout
        self._ranks_of[name] = tuple(sorted({s.rank for s in layout.shards}))
        tags = pb.ShardTags(tensor_model_parallel=layout.tp_sharded,
                            partition_dim=layout.tp_dim or 0,
                            is_gtp_weight_remat=layout.gtp_sharded,
                            pad_length=layout.pad_length)
        for s in layout.shards:
            domain = pb.Domain(name=self.domain_name, gtp_size=self.gtp_size,
                               tp_size=self.tp_size, g=s.g, t=s.t)
            wg = self._wire_group(wire, s.rank, gi, gname, group, domain)
            wg.params.append(pb.Param(name=name, full_shape=list(layout.full_shape),
                                      param=pbuf.ref(s.offset, s.shape, s.strides),
                                      grad=gbuf.ref(s.offset, s.shape, s.strides), tags=tags))

    def _place_solo(self, gi, gname, group, name, p, rank, wire):
        pbuf, gbuf = self._rebind(p, p.numel())
        self.layouts[name] = ("solo", rank)
        self._ranks_of[name] = (rank,)
        shape, strides = _whole(p)
        domain = pb.Domain(name=f"solo-r{rank}", gtp_size=1, tp_size=1, g=0, t=0)
        # A group name names one domain on the wire (the coordinator checks that
        # every rank holding it agrees), so each daemon's 1x1 group is its own.
        wname = f"{gname}.solo-r{rank}"
        wg = self._wire_group(wire, rank, gi, wname, group, domain)
        wg.params.append(pb.Param(name=name, full_shape=list(p.shape),
                                  param=pbuf.ref(0, shape, strides),
                                  grad=gbuf.ref(0, shape, strides), tags=pb.ShardTags()))

    def _compute_places(self, todo) -> dict:
        """Local mode: this rank's place of every param (muond.placement;
        no communication)."""
        opts = _placement.Options(
            rank=self._rank, world=self._world, domain=self.domain_name,
            gtp_size=self.gtp_size, tp_size=self.tp_size, g=self.g, t=self.t,
            dp_size=self._dp[0], dp_rank=self._dp[1],
            given_grid=self.gtp_size * self.tp_size > 1 or self.g != 0 or self.t != 0)
        requests = [_placement.Request(name, p, group["algorithm"])
                    for _, _, group, name, p in todo]
        return _placement.place_params(requests, opts)

    def _bind_dtensor(self, p):
        """A DTensor param's shared buffers (at least one element: a 0-row
        shard gets a 0-row view), its local values copied in. The param is
        never rebound (FSDP2 owns its storage): step() copies in and out."""
        local = p.to_local()
        n = local.numel()
        pbuf = _Buffer(self.job_id, max(n, 1), local, self._regions)
        gbuf = _Buffer(self.job_id, max(n, 1), local, self._regions)
        self._buffers += [pbuf, gbuf]
        with torch.no_grad():
            pview = pbuf.flat[:n].view(local.shape)
            pview.copy_(local)
            gview = gbuf.flat[:n].view(local.shape)
        self._dtensors.append((p, pview, gview))
        return pbuf, gbuf, local

    def _place_local(self, gi, gname, group, name, p, wire):
        place = self.places[name]
        self.layouts[name] = "local"
        self._ranks_of[name] = (0,)
        if _placement.is_dtensor(p):
            pbuf, gbuf, local = self._bind_dtensor(p)
            shape, strides = _whole(local)
        else:
            pbuf, gbuf = self._rebind(p, p.numel())
            shape, strides = _whole(p)
        if place.kind in ("dtensor", "ddp", "solo"):
            tags = pb.ShardTags(tensor_model_parallel=place.tp_dim is not None,
                                partition_dim=place.tp_dim or 0,
                                is_gtp_weight_remat=place.gtp_sharded,
                                pad_length=place.pad_length, gtp_rows=list(place.gtp_rows))
            # A group's params may live in several domains (meshes), and one
            # wire group names one domain: one wire group per domain, named
            # the same on every rank.
            wname = f"{gname}{'.' if place.kind == 'solo' else '@'}{place.domain}"
        else:  # Megatron tags, as given
            tags = pb.ShardTags(tensor_model_parallel=bool(getattr(p, "tensor_model_parallel",
                                                                   False)),
                                partition_dim=int(getattr(p, "partition_dim", 0)),
                                is_gtp_weight_remat=place.gtp_sharded,
                                pad_length=place.pad_length)
            wname = gname
        domain = pb.Domain(name=place.domain, gtp_size=place.G, tp_size=place.T, g=place.g,
                           t=place.t, dp_size=place.D if place.D > 1 else 0,
                           d=place.d if place.D > 1 else 0)
        wg = self._wire_group(wire, 0, gi, wname, group, domain)
        wg.params.append(pb.Param(name=name, full_shape=list(place.full_shape),
                                  param=pbuf.ref(0, shape, strides),
                                  grad=gbuf.ref(0, shape, strides), tags=tags))

    # -- optimizer API -----------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim: ``set_to_none=True`` (the default) sets every
        ``.grad`` to None (step() skips a param whose grad stays None, and
        copies a new grad into the shared buffer); ``set_to_none=False``
        zeroes the shared grad in place and points ``.grad`` at it (the next
        backward accumulates where the daemons read: no copy at step()).
        Unlike torch, set_to_none=False also gives a param whose ``.grad``
        was None the zeroed shared grad (when it requires grad): that is how
        the zero-copy loop starts on a fresh model; such a param is then
        stepped with a zero grad unless a backward reaches it."""
        with torch.no_grad():
            for p, grad in self._grads:
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad is None and not p.requires_grad:
                    continue
                if p.grad is not grad:
                    p.grad = grad
                grad.zero_()
            for p, _, _ in self._dtensors:  # their grads stay FSDP2's / DTensor's
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def _skipped_and_copy_grads(self) -> list[list[str]]:
        """Per daemon, the names of the params this step skips (grad None or
        requires_grad False, as torch.optim skips grad None); every other
        grad not already in its shared buffer is copied there in one batched
        copy, and ``.grad`` re-pointed to the shared buffer."""
        skipped: list[list[str]] = [[] for _ in self.clients]
        dst, src = [], []
        for p, grad in self._grads:
            current = p.grad
            if current is None or not p.requires_grad:
                name = self._param_names[id(p)]
                for rank in self._ranks_of[name]:
                    skipped[rank].append(name)
                continue
            if current is grad:  # the usual case: backward accumulated in place
                continue
            if current.data_ptr() != grad.data_ptr():
                dst.append(grad)
                src.append(current)
            p.grad = grad
        for p, pview, gview in self._dtensors:
            # Every DTensor's values go in (a skipped one is copied back
            # unchanged), the grads of those stepped.
            dst.append(pview)
            src.append(p.to_local())
            if p.grad is None or not p.requires_grad:
                skipped[0].append(self._param_names[id(p)])
                continue
            dst.append(gview)
            src.append(_local_grad(p))
        if dst:
            torch._foreach_copy_(dst, src)
        return skipped

    def _any_cuda(self) -> bool:
        return (any(grad.is_cuda for _, grad in self._grads)
                or any(gview.is_cuda for _, _, gview in self._dtensors))

    def _copy_dtensors_out(self) -> None:
        """The updated DTensor params back into their own local tensors."""
        if self._dtensors:
            torch._foreach_copy_([p.to_local() for p, _, _ in self._dtensors],
                                 [pview for _, pview, _ in self._dtensors])

    def _check_fixed(self) -> None:
        """Raises before any RPC when a group entry the daemons fixed at
        registration changed (a change would otherwise be a silent no-op)."""
        for gi, group in enumerate(self.param_groups):
            registered = self._fixed.get(gi)
            if registered is None:
                continue
            for key, value in registered.items():
                now = _frozen(group[key]) if key in group else "<removed>"
                if now != value:
                    algorithm = group["algorithm"]
                    given = group[key] if key in group else "<removed>"
                    raise ValueError(
                        f"param group {gi} ({group.get('name', f'group{gi}')!r}): {key!r} "
                        f"changed from {_thawed(value)!r} to {given!r} after construction; "
                        "muond fixes "
                        f"it when it registers the group (the {algorithm} group's per-step "
                        f"entries are {', '.join(LIVE_KEYS[algorithm])}); build a new "
                        "optimizer to change it")

    def _follow_rebound_params(self) -> None:
        """A param whose tensor was replaced after construction (``p.data =``,
        ``model.to()`` / ``.half()`` that moved it) is followed when the new
        tensor has the same shape, dtype and device: its values are copied into
        the shared buffer the daemons update and ``p.data`` is bound to it
        again. Otherwise step() refuses before any RPC, naming the param and
        what changed (the daemons can only update the memory registered)."""
        refused = []
        for p, view, ptr in self._views:
            # Cheap per step (~0.3 us a param): the param itself, not p.data
            # (no alias tensor), against the cached address. The same address
            # and shape with other strides would be a view of our own buffer.
            if p.data_ptr() == ptr and p.shape == view.shape and p.dtype is view.dtype:
                continue
            data = p.data
            changed = [f"{what} {a} -> {b}" for what, a, b in (
                ("shape", tuple(view.shape), tuple(data.shape)),
                ("dtype", view.dtype, data.dtype), ("device", view.device, data.device))
                if a != b]
            if changed:
                refused.append(f"param {self._param_names[id(p)]}: {', '.join(changed)}")
        if refused:
            raise ValueError(
                "muond.torch.Muon follows a param rebound after construction only to a tensor "
                "of the same shape, dtype and device (its registered memory cannot change); "
                + "; ".join(refused) + ". Build a new optimizer for the changed model (carry "
                "the state with state_dict / load_state_dict)")
        with torch.no_grad():
            for p, view, ptr in self._views:
                if p.data_ptr() != ptr:
                    view.copy_(p.data)
                    p.data = view

    def _overrides(self, rank: int) -> list[pb.GroupOverride]:
        """The live hyperparameters (LIVE_KEYS) of every group this daemon
        holds, read from param_groups now (LR schedulers, momentum warm-up);
        a daemon never sees a group it does not hold."""
        return [_override(wname, self.param_groups[gi])
                for gi, wname in self._wire_groups.get(rank, [])]

    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("muond.torch.Muon.step after close()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_fixed()
        self._follow_rebound_params()
        self.state.push_if_assigned()
        self.state.invalidate()  # the step changes the state: read it afresh
        skipped = self._skipped_and_copy_grads()
        if self._on_cuda:
            torch.cuda.synchronize()  # the daemon reads grads from another process
        # The id advances only when every daemon applied the step: a refused
        # step (e.g. non-finite gradients, refused on every rank before
        # anything changed) can be retried with the same id.
        step_id = self.step_id + 1
        overrides = [self._overrides(r) for r in range(len(self.clients))]
        what = f"Step {step_id}"
        t0 = time.perf_counter()
        if len(self.clients) == 1:  # a blocking call: no future, no extra thread
            first = self.clients[0]
            responses = [_result(lambda: first.step(self.job_id, step_id, overrides[0],
                                                    self.client_id, skipped[0]), first, what)]
        else:
            futures = [c.step_future(self.job_id, step_id, overrides[r], self.client_id,
                                     skipped[r])
                       for r, c in enumerate(self.clients)]
            responses = _gather(futures, self.clients, what)
        self._copy_dtensors_out()
        self.step_id = step_id
        rpc_us = (time.perf_counter() - t0) * 1e6
        timings = {k: max(getattr(r.timings, k) for r in responses) for k in _PHASES}
        timings["rpc_us"] = rpc_us
        timings["overhead_us"] = rpc_us - timings["total_us"]
        self.last_timings = timings
        self.last_responses = responses
        return loss

    def status(self):
        return [c.status() for c in self.clients]

    # -- optimizer state (muond.state converts; the daemons hold it) -------
    def _param_infos(self) -> list[_state.ParamInfo]:
        """Every param in torch.optim's index order, with where its state lives."""
        infos = []
        for group in self.param_groups:
            for p in group["params"]:
                name = self._param_names[id(p)]
                infos.append(_state.ParamInfo(name, group["algorithm"], _state.local_shape(p),
                                              self.layouts[name], _state.dist_spec(p)))
        return infos

    def _fetch_state(self) -> dict:
        """param -> torch.optim's state of it, assembled from every daemon's
        ExportState (tensors on the param's device; a DTensor param's state
        DTensors of its placements, muond.state.as_dtensor)."""
        if self._closed:
            raise RuntimeError("muond.torch.Muon: the state lives in the daemons, and this "
                               "optimizer is closed")
        exported = self._on_all(lambda c: c.export_state(self.job_id, self.client_id),
                                "ExportState")
        infos = self._param_infos()
        by_name = _state.assemble(infos, {r: e for r, (_, e) in enumerate(exported)})
        info_of = {info.name: info for info in infos}
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                name = self._param_names[id(p)]
                out[p] = {k: v if k == "step" else
                          _state.as_dtensor(info_of[name], v.to(p.device))
                          for k, v in by_name[name].items()}
        return out

    def _push_state(self, states_by_name: dict, step_id: int) -> None:
        """Imports ``states_by_name`` (muond.state.validate's result) into every
        daemon, all or nothing: each daemon checks and stages its entries under
        one transaction id, then all commit; if any refuses, all abort."""
        per_rank = _state.disassemble(self._param_infos(), states_by_name, len(self.clients))
        txn = f"{self.client_id}-{uuid.uuid4().hex[:12]}"
        try:
            self._on_all(lambda c, r: c.import_state(self.job_id, self.client_id, step_id,
                                                     per_rank[r], transaction_id=txn),
                         "ImportState", with_rank=True)
        except BaseException:
            for c in self.clients:
                try:
                    c.abort_state(self.job_id, self.client_id, txn)
                except Exception:  # not staged there, or unreachable: nothing to drop
                    pass
            raise
        # Every daemon validated and staged its part: COMMIT no longer fails
        # on the content, only if a daemon is gone.
        self._on_all(lambda c: c.commit_state(self.job_id, self.client_id, txn),
                     "LoadState COMMIT")
        self.state.invalidate()

    def _on_all(self, call, what: str, with_rank: bool = False) -> list:
        """call(client) on every daemon concurrently; results in rank order,
        the first failure raised as a MuondError naming the daemon and `what`."""
        def run(r, c):
            return _result(lambda: call(c, r) if with_rank else call(c), c, what)
        if len(self.clients) == 1:
            return [run(0, self.clients[0])]
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(run, r, c) for r, c in enumerate(self.clients)]
            return [f.result() for f in futures]

    def state_dict(self):
        """torch.optim's format: "state" keyed by param index, each param's
        state fetched from the daemons (Muon: {"momentum_buffer"}, AdamW:
        {"step", "exp_avg", "exp_avg_sq"}; full param shapes), "param_groups"
        with every group's options and the job's step id as "muond_step_id"
        (kept by torch.distributed.checkpoint, unlike a top-level key)."""
        return self._pack_state_dict(self.state.items())

    def _pack_state_dict(self, states) -> dict:
        """torch.optim's state dict of ``states`` ((param, its state) pairs or
        a dict of them) and this optimizer's groups and step id."""
        states = dict(states)
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            packed[_state.STEP_ID_KEY] = self.step_id
            groups.append(packed)
        # Copies: opt.state's cache must keep what the daemons hold even if
        # the caller edits the returned tensors in place.
        state = {index[id(p)]: {k: v.clone() for k, v in s.items()}
                 for p, s in states.items()}
        # Also at the top level, where torch.save keeps it and older muond
        # state dicts had it (load_state_dict reads either).
        return {"state": state, "param_groups": groups, _state.STEP_ID_KEY: self.step_id}

    def load_state_dict(self, state_dict):
        """Checks ``state_dict`` (torch.optim's format: ours, or a
        torch.optim.Muon / AdamW one, whose state is converted to fp32 and
        whose missing step id keeps this optimizer's), then imports the state
        into every daemon all or nothing and sets the groups' options and the
        step id. On any error nothing changes (ValueError naming the param and
        the rule for a bad state dict)."""
        groups, states = self._check_state_dict(state_dict)
        step_ids = {check_step_id(g[_state.STEP_ID_KEY]) for g in state_dict["param_groups"]
                    if _state.STEP_ID_KEY in g}
        if not step_ids and _state.STEP_ID_KEY in state_dict:
            step_ids = {check_step_id(state_dict[_state.STEP_ID_KEY])}
        if len(step_ids) > 1:
            raise ValueError(f"param_groups disagree on {_state.STEP_ID_KEY}: {sorted(step_ids)}")
        step_id = int(step_ids.pop()) if step_ids else self.step_id
        self._push_state(states, step_id)
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)
        self.step_id = step_id

    def _check_state_dict(self, state_dict):
        """(each group's options to apply, param name -> fp32 state), or a
        ValueError naming what is wrong; nothing changes here."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("state_dict must have 'state' and 'param_groups' (torch.optim's "
                             "format: opt.state_dict())")
        saved_groups = list(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this "
                             f"optimizer has {len(self.param_groups)}")
        by_index, groups = {}, []
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {gi}: loaded group has {len(saved['params'])} "
                                 f"params, this optimizer's has {len(group['params'])}")
            if saved.get("algorithm", group["algorithm"]) != group["algorithm"]:
                raise ValueError(f"param group {gi}: algorithm {saved['algorithm']!r} in the "
                                 f"state dict, {group['algorithm']!r} here")
            for index, p in zip(saved["params"], group["params"]):
                by_index[index] = self._param_names[id(p)]
            groups.append(_loaded_options(gi, group, saved))
            # Types and finiteness here; bounds (momentum < 1, ...) are the
            # daemon's and step() names them.
            check_live(gi, {**group, **groups[-1]})
        unknown = sorted(set(state_dict["state"]) - set(by_index), key=str)
        if unknown:
            raise ValueError(f"state for param indices {unknown} that no param group lists")
        states = {by_index[i]: s for i, s in state_dict["state"].items()}
        return groups, _state.validate(self._param_infos(), states)

    def __getstate__(self):
        raise TypeError(
            "muond.torch.Muon cannot be pickled (torch.save(opt), copy.deepcopy): its state "
            "lives in the daemons and its params in memory registered with them. Save "
            "opt.state_dict() instead and load it into a new muond.torch.Muon with "
            "load_state_dict()")

    def add_param_group(self, param_group):
        """torch.optim's add_param_group, also after construction (progressive
        unfreezing): the new group is checked here first (torch's checks,
        algorithm, dtype, Muon params 2-D, names, hyperparameter types; a bad
        group changes nothing), then the state of every daemon is exported,
        the params unregistered, all groups placed and registered again
        (placement may move params between daemons; the old groups with the
        live values they were last registered with), the old params' state
        imported (the new params start from zero, as in torch.optim) and the
        step id kept. In local mode every trainer of the domain must call it
        together, with matching groups. If the re-registration fails, the old
        groups are registered again with their state and the error is raised;
        if that fails too, AddParamGroupError: the optimizer is closed and
        unregistered, and the error's ``state_dict`` resumes a new one."""
        if not getattr(self, "_registered", False):  # torch.optim.Optimizer.__init__
            if isinstance(param_group, dict):
                param_group = _from_torch_keys(param_group)
            super().add_param_group(param_group)
            _with_torch_keys(self.param_groups[-1])
            return
        if self._closed:
            raise RuntimeError("muond.torch.Muon.add_param_group after close()")
        if isinstance(param_group, dict) and param_group.get("algorithm") == "adamw":
            param_group = dict(param_group)
            param_group.setdefault("eps", self._adamw_eps)
        kept = len(self.param_groups)
        if isinstance(param_group, dict):
            param_group = _from_torch_keys(param_group)
        super().add_param_group(param_group)  # torch's checks; appends on success
        _with_torch_keys(self.param_groups[-1])
        new_group = self.param_groups.pop()  # back only once registered
        self._check_new_group(kept, new_group)
        self._follow_rebound_params()
        self.state.push_if_assigned()
        step_id = self.step_id
        if getattr(self, "_registered_live", None) is None:
            self._registered_live = dict(self._placed_live)  # the constructor's
        before = self._registered_live
        by_param = self._fetch_state()
        # DTensors stay where they are (their mesh names the device).
        old = {self._param_names[id(p)]: {k: v if _state.is_dtensor(v) else v.cpu()
                                          for k, v in s.items()}
               for p, s in by_param.items()}
        saved = self._pack_state_dict(by_param)  # handed out if all else fails
        self.param_groups.append(new_group)
        try:
            self._reregister(old, step_id)
        except BaseException as error:
            del self.param_groups[kept:]
            self._registered_live = before
            try:
                self._reregister(old, step_id)
            except Exception as again:
                self.close()  # unregisters everywhere (best effort): a new optimizer can
                raise AddParamGroupError(
                    f"add_param_group failed ({error}) and registering the old groups "
                    f"again failed too ({again}); this optimizer is closed and unregistered. "
                    "Its state is in this error's .state_dict: build a new muond.torch.Muon "
                    "with the old groups and call load_state_dict(error.state_dict)",
                    saved) from error
            raise

    def _check_new_group(self, gi: int, group: dict) -> None:
        """Everything about a group added after construction that can be
        checked without a daemon (ValueError naming group/param and rule)."""
        label = _group_label(gi, group)
        algorithm = group.get("algorithm")
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"{label}: algorithm {algorithm!r} not in ('muon', 'adamw')")
        if algorithm == "adamw":
            _check_adamw_options(gi, group)
        gname = group.get("name", f"group{gi}")
        taken = {g.get("name", f"group{i}") for i, g in enumerate(self.param_groups)}
        if gname in taken:
            raise ValueError(f"{label}: group name {gname!r} is already a group's")
        names = group.get("param_names") or [f"{gname}.param{j}"
                                              for j in range(len(group["params"]))]
        if len(names) != len(group["params"]):
            raise ValueError(f"{label}: {len(names)} param_names for "
                             f"{len(group['params'])} params")
        known = set(self._param_names.values())
        for name, p in zip(names, group["params"]):
            if name in known:
                raise ValueError(f"{label}: param name {name!r} appears twice")
            known.add(name)
            if p.dtype not in _DTYPES:
                raise ValueError(f"param {name}: dtype {p.dtype} not in (float32, bfloat16)")
            if algorithm == "muon" and p.ndim != 2:
                raise ValueError(f"param {name}: Muon params must be 2-D, got shape "
                                 f"{tuple(p.shape)}; put it in an algorithm='adamw' group")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"param {name}: muond handles cpu and cuda tensors, got "
                                 f"{p.device}")
        check_live(gi, group)
        if algorithm == "muon":
            check_gram_options(gi, group)
        try:
            _set_hyperparams(pb.ParamGroup(), group)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{label}: {e}") from e

    def _reregister(self, states_by_name: dict, step_id: int) -> None:
        """Unregisters, places and registers every group anew (fresh buffers;
        values and accumulated grads carried over), then imports
        ``states_by_name`` (params without an entry start from zero)."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._on_all(lambda c: c.unregister(self.job_id, self.client_id), "UnregisterParams")
        old_buffers = list(self._buffers)
        self._buffers.clear()  # the same list the finalizer releases
        self._regions, self._grads, self._views, self._dtensors = _Regions(), [], [], []
        self._wire_groups, self.layouts = {}, {}
        self._param_names, self._ranks_of, self._fixed = {}, {}, {}
        self.state.invalidate()
        per_rank = self._place_params()  # copies values and grads into fresh buffers
        for b in old_buffers:
            b.release()
        self._on_all(lambda c, r: c.register(self.job_id, per_rank[r], self.client_id,
                                             regions=self._regions.used_by(per_rank[r])),
                     "RegisterParams", with_rank=True)
        for c in self.clients:
            c.wait_healthy(self._wait_healthy_timeout, need_plan=True)
        self._registered_live = dict(self._placed_live)
        self._on_cuda = self._any_cuda()
        known = {self._param_names[id(p)] for p in params}
        states = _state.validate(self._param_infos(),
                                 {n: s for n, s in states_by_name.items() if n in known})
        self._push_state(states, step_id)
        self.step_id = step_id

    def close(self) -> None:
        """Unregisters from every daemon and unlinks the shm names. The model
        keeps its (now private) memory and works on; this optimizer does not."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # unregisters, closes the channels, frees the shm

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ParamState(dict):
    """One param's entry of ``opt.state``: assigning a key (``opt.state[p]
    ["momentum_buffer"] = t``) marks the state for import before the next
    step, as assigning the whole entry does."""

    def __init__(self, values: dict, owner: "_LazyState"):
        super().__init__(values)
        self._owner = owner

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._owner._dirty = True

    def __delitem__(self, key):
        super().__delitem__(key)
        self._owner._dirty = True


class _LazyState(MutableMapping):
    """``opt.state`` as torch.optim has it (param -> {"momentum_buffer": ...}),
    read from the daemons on first access and cached until the next step,
    load_state_dict or add_param_group. Always truthy (one entry per param,
    no RPC to know that): torch.distributed.checkpoint steps an optimizer whose
    ``state`` is empty to create it, which would be a real step here. Every
    change reaches the daemons before the next step (imported, all or
    nothing): an assigned entry (Lightning's ``_optimizer_to_device`` writes
    every entry back), an assigned key of an entry, and an in-place edit of a
    fetched tensor (seen by its ``_version``, which torch bumps on every
    in-place op: a cheap check of the fetched tensors at step())."""

    def __init__(self, opt: "Muon"):
        self._opt = opt
        self._cache = None
        self._dirty = False
        self._versions: list = []  # (fetched tensor, its _version when fetched)

    def _params(self):
        return [p for group in self._opt.param_groups for p in group["params"]]

    def _loaded(self) -> dict:
        if self._cache is None:
            fetched = self._opt._fetch_state()
            self._cache = {p: _ParamState(s, self) for p, s in fetched.items()}
            # A DTensor's in-place edits bump its local shard's _version.
            self._versions = [(local, local._version) for s in fetched.values()
                              for local in map(_state.local_of, s.values())]
        return self._cache

    def invalidate(self) -> None:
        self._cache, self._dirty, self._versions = None, False, []

    def __getitem__(self, p):
        if p not in self:
            raise KeyError("not a param of this optimizer")
        return self._loaded()[p]

    def __setitem__(self, p, value):
        if p not in self:
            raise KeyError("muond.torch.Muon keeps state only for its own params")
        self._loaded()[p] = _ParamState(value, self)
        self._dirty = True

    def __delitem__(self, p):
        raise TypeError("muond.torch.Muon's state lives in the daemons; load_state_dict "
                        "replaces it")

    def __contains__(self, p):
        # Every param of this optimizer has a wire name (O(1), no tensor ==).
        return isinstance(p, torch.Tensor) and id(p) in self._opt._param_names

    def __iter__(self):
        return iter(self._params())

    def __len__(self):
        return len(self._params())

    def _changed(self) -> bool:
        return self._dirty or any(v._version != seen for v, seen in self._versions)

    def push_if_assigned(self) -> None:
        """Imports the cached state into the daemons when it was changed
        (assigned, or a fetched tensor edited in place)."""
        if self._cache is None or not self._changed():
            return
        opt = self._opt
        states = _state.validate(opt._param_infos(),
                                 {opt._param_names[id(p)]: s for p, s in self._cache.items()})
        opt._push_state(states, opt.step_id)


def _loaded_options(gi: int, group: dict, saved: dict) -> dict:
    """The entries of a loaded param group that load_state_dict applies: the
    live ones (LIVE_KEYS). An entry fixed at registration must equal this
    group's (else ValueError naming group and key: the daemons could not
    follow it); entries this group does not have (a torch.optim.Muon dict's
    ns_coefficients, adjust_lr_fn, AdamW's foreach, ...) are not taken."""
    live = LIVE_KEYS[group["algorithm"]]
    apply = {}
    for key, value in saved.items():
        if key in _PARAM_KEYS or key == _state.STEP_ID_KEY or key not in group:
            continue
        if key in live or key in _KERNEL_KEYS:
            apply[key] = value
        elif _frozen(_torch_default(key, value)) != _frozen(_torch_default(key, group[key])):
            raise ValueError(f"param group {gi} ({group.get('name', f'group{gi}')!r}): {key!r} "
                             f"is {value!r} in the state dict, {group[key]!r} here; muond fixes "
                             "it when it registers the group: build the optimizer with it")
    return apply


def _torch_default(key: str, value):
    """torch.optim.Muon's adjust_lr_fn None means "original"; muond's
    gram_min_aspect_ratio None and 0 both mean the measured default."""
    if key == "adjust_lr_fn" and value is None:
        return "original"
    if key == "gram_min_aspect_ratio" and value is None:
        return 0.0
    return value


def _whole(p: torch.Tensor):
    """Shape/strides of a whole param on the wire: 2-D as is, else flat 1-D."""
    if p.ndim == 2:
        return list(p.shape), [p.shape[1], 1]
    return [p.numel()], [1]


def _gather(futures, clients, what: str):
    """The responses of concurrent calls, one per daemon, in rank order. The
    first failure is raised at once (as _result's MuondError) and the other
    calls are cancelled: a peer of a failed step may never answer (a stopped
    daemon), and waiting for it would hang the trainer."""
    changed = threading.Event()
    for f in futures:
        f.add_done_callback(lambda _: changed.set())
    pending = set(range(len(futures)))
    while pending:
        changed.clear()
        for i in sorted(pending):
            if not futures[i].done():
                continue
            pending.discard(i)
            if futures[i].exception() is not None:
                for j in pending:
                    futures[j].cancel()
                _result(futures[i].result, clients[i], what)  # raises
        if pending:
            changed.wait()
    return [_result(f.result, c, what) for f, c in zip(futures, clients)]


def _result(call, client: Client, what: str):
    """call(): an RPC's response (e.g. a future's ``result``); its grpc error
    as a MuondError (a RuntimeError) naming the daemon and the RPC, with the
    status code and the daemon's reason (e.g. PEER_GONE) as attributes."""
    try:
        return call()
    except MuondError:  # the client's own (export/import_state): names the daemon already
        raise
    except grpc.RpcError as e:
        detail = e.details() if hasattr(e, "details") else str(e)
        code = e.code() if hasattr(e, "code") else None
        info = error_info(e)
        reason = info.reason if info else ""
        metadata = dict(info.metadata) if info else None
        if not reason and code is not None and code.name == "UNAVAILABLE":
            # No daemon answered at all (its process is gone or its socket
            # refuses): the trainer recovers exactly as from a peer's
            # PEER_GONE, so it gets the same reason to branch on.
            reason, metadata = PEER_GONE, {"daemon": client.address}
        raise MuondError(f"muond daemon {client.address}: {what} failed: "
                         f"{code.name if code is not None else type(e).__name__}: {detail}",
                         code=code, reason=reason, metadata=metadata) from e


def _local_grad(p) -> torch.Tensor:
    """A DTensor param's grad as a local tensor shaped like its local shard
    (a grad with other placements, e.g. Partial, redistributed first)."""
    grad = p.grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local()


def _process_rank() -> tuple[int, int]:
    """(rank, world) of torch.distributed's default group, (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_object(obj) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _agree_registered(refused: BaseException | None, rank: int) -> None:
    """Every rank of a distributed job learns whether every other rank's
    RegisterParams succeeded, and all raise the first refusal alike
    (``rank r: <reason>``, a MuondError with its code, reason and metadata)."""
    mine = None
    if refused is not None:
        mine = {"message": str(refused), "code": getattr(refused, "code", None),
                "reason": getattr(refused, "reason", ""),
                "metadata": dict(getattr(refused, "metadata", None) or {})}
    every = _all_gather_object(mine)
    failed = [(r, f) for r, f in enumerate(every) if f is not None]
    if not failed:
        return
    r, first = failed[0]
    others = [f for f, _ in failed[1:]]
    raise MuondError(f"rank {r}: RegisterParams refused: {first['message']}"
                     + (f" (ranks {others} refused too)" if others else ""),
                     code=first["code"], reason=first["reason"],
                     metadata=first["metadata"]) from refused


def _release(buffers) -> None:
    for b in buffers:
        b.release()


# Unregistering at exit must not hold up the interpreter on a daemon that is
# gone: each call gets this many seconds.
_FINAL_UNREGISTER_TIMEOUT_S = 2.0


def _finalize(buffers, clients, job_id: str, client_id: str, pid: int) -> None:
    """The optimizer's end (close(), garbage collection or interpreter exit):
    unregisters from every daemon (best effort: a daemon may be gone, or never
    registered us), closes the channels and frees the shm. Only the process
    that built the optimizer unregisters (a forked child inherits it)."""
    if os.getpid() == pid:
        for c in clients:
            try:
                c.unregister(job_id, client_id, timeout=_FINAL_UNREGISTER_TIMEOUT_S)
            except Exception:  # gone, or held by another client: nothing of ours
                pass
            try:
                c.close()
            except Exception:
                pass
    _release(buffers)


def _is_stale_local_client(client_id: str) -> bool:
    """True when ``client_id`` is a default muond.torch id
    (``<hostname>-<pid>-<8 hex>``) of this host whose process no longer
    exists: that trainer ended without unregistering (killed, crashed)."""
    host, _, rest = client_id.rpartition("-")
    host, _, pid = host.rpartition("-")
    if host != os.uname().nodename or not (pid.isascii() and pid.isdigit()) or len(rest) != 8:
        return False
    try:
        int(rest, 16)
    except ValueError:
        return False
    if int(pid) == os.getpid():
        return False  # another optimizer of this very process: alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: exists, another user's
        return False
    return False
