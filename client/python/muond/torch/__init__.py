"""``muond.torch.Muon``: a torch.optim.Optimizer whose step runs on muond daemons.

    from muond.torch import Muon
    opt = Muon([{"params": matrices},
                {"params": others, "algorithm": "adamw", "lr": 3e-3, "betas": (0.9, 0.95)}],
               lr=3e-3, daemons=["unix:///tmp/muond-job-0.sock", ...], job_id="job",
               gtp_size=2, tp_size=2)
    ...
    opt.zero_grad(); loss.backward(); opt.step()

The constructor mirrors ``torch.optim.Muon`` (lr, weight_decay, momentum, nesterov,
ns_coefficients, eps, ns_steps, adjust_lr_fn) plus muond's options, given as
option objects (NewtonSchulzOptions, ScalingOptions, AdamWOptions,
StateStorageOptions, PlacementOptions, ConnectionOptions: muond.torch.options) or as the flat
keywords of the same names; its defaults are torch's, Newton-Schulz on bf16
operands included (fp32_matmul_prec="medium"; "highest" runs it in fp32). Groups with
``"algorithm": "adamw"`` take AdamW (their own lr, betas, eps, weight_decay).

A plain iterable of params or of (name, param) pairs (``model.parameters()``,
``model.named_parameters()``) becomes a Muon group of its 2-D params and an
AdamW group of all others (biases, norm weights, scalars, conv kernels; the
constructor's lr and weight_decay), silently, as torch.optim.Muon's users
split them by hand (muond.torch.initial_groups.split_plain_params); with no
other param it stays one Muon group. In explicit param groups every param of
a Muon group is a matrix, or a batch of matrices ``[..., m, n]`` (experts:
muond.batched); a 0-D or 1-D one is a ValueError naming it and the AdamW
group to use.

Memory. At construction every param is moved once into memory the daemons can
map, and the model's ``param.data`` is rebound to it (same Parameter objects):
all params of one dtype are packed into one POSIX shm object (CPU,
muond.shm) or one CUDA allocation shared by IPC handle (per device), as DDP
and Megatron keep flat buffers, each param a 256-byte aligned view. Each
buffer is declared once to a daemon as a memory region, and every tensor
refers to its region by name + byte offset (docs/ARCHITECTURE.md "Memory
registration"; muond.torch.memory): the open files of trainer and daemon do
not grow with the number of params. Each param also gets a grad view in such
buffers (apart from the params'); construction leaves ``.grad`` as it was (None on a fresh model,
as torch.optim). ``zero_grad(set_to_none=False)`` zeroes the shared grad and
points ``.grad`` at it, so backward accumulates there in place (no copy);
``zero_grad()`` (torch's default, set_to_none) sets ``.grad`` to None, so the
next backward allocates a new grad, which ``step()`` copies into the shared
grad (one batched copy) before re-pointing ``.grad`` to it. As in
torch.optim, a param whose ``.grad`` is None at ``step()``, or that does not
require grad, is skipped (StepRequest.skip_params). A param without elements
goes to no daemon and has no state: a no-op, as in torch.optim.

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
  rank's daemon from the environment, muond.torch.discovery): each param's
  domain and coordinates come from muond.torch.placement — DTensor params (FSDP2,
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
concurrently and returns when all answered (params updated in place); with
one daemon, through a step channel in shared memory where the daemon offers
one (``step_channel``, muond.step_channel). CUDA: the current device is
synchronised before the RPC. ``last_timings`` holds
per-phase daemon times (max over daemons, µs), ``rpc_us`` (client wall time
of the concurrent RPCs) and ``overhead_us = rpc_us - total_us``.

State: the daemons hold it; ``state_dict`` / ``load_state_dict`` / ``state``
carry it in torch.optim's format (ExportState / ImportState; conversions and
checks in muond.state). ``add_param_group`` re-registers every group and
carries the state over. A param rebound after construction is followed when
the new tensor matches the registered one's shape, dtype and device, else
refused at step(). The optimizer does not pickle: save its state_dict.

Modules: ``optimizer`` (Muon, the torch.optim surface), ``options`` (the
option objects), ``initial_groups`` (the constructor's params as groups),
``groups`` (group options, torch-key translation, the checks before any
RPC), ``process_guard`` (only the creating process steps), ``layouts`` (one
layout strategy per shard_mode), ``placement`` / ``discovery`` (local mode's
domains; this rank's daemon),
``memory`` (shm / CUDA regions and buffers, CUDA IPC handles),
``registration`` / ``collective`` (RegisterParams, takeover, the ranks'
agreement), ``wire`` (groups to proto), ``rpc`` (one call on every daemon),
``lazy_state`` (``opt.state``).
"""
try:
    import torch  # noqa: F401  (the one dependency muond.torch adds)
except ImportError as _missing:
    # A bare ModuleNotFoundError deep in the import chain does not say which
    # install gives it: the extra does (pyproject.toml).
    raise ImportError(
        f"muond.torch needs PyTorch, which could not be imported ({_missing}): "
        "pip install 'muond[torch]' (or install torch>=2.5 yourself)") from _missing

# The client's errors and reasons, importable from here as before the
# package existed (`except muond.torch.MuondError`).
from muond.client import (ALREADY_REGISTERED, PEER_GONE, REFUSED_BY_PEER, TRAINER_REFUSED,
                          Client, InvalidArgumentError, MuondError, error_info)
from muond.shm import ShmBuffer
from muond.torch.groups import (LIVE_KEYS, MAX_STEP_ID, check_gram_options, check_live,
                                check_step_id)
from muond.torch.memory import CUDA_IPC_HANDLE_SIZE
from muond.torch.optimizer import AddParamGroupError, Muon
from muond.torch.options import (AdamWOptions, ConnectionOptions, NewtonSchulzOptions,
                                 PlacementOptions, ScalingOptions, StateStorageOptions)
from muond.torch.qk_clip import QKClip, QKClipAttention, QKClipMLA, reduce_max_logits

__all__ = [
    "ALREADY_REGISTERED", "Client", "InvalidArgumentError", "MuondError", "PEER_GONE",
    "REFUSED_BY_PEER", "ShmBuffer", "TRAINER_REFUSED", "error_info",
    "AdamWOptions", "AddParamGroupError", "CUDA_IPC_HANDLE_SIZE", "ConnectionOptions",
    "LIVE_KEYS", "MAX_STEP_ID", "Muon", "NewtonSchulzOptions", "PlacementOptions",
    "QKClip", "QKClipAttention", "QKClipMLA", "ScalingOptions", "StateStorageOptions",
    "check_gram_options",
    "check_live", "check_step_id", "reduce_max_logits",
]
