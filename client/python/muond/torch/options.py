"""Muon's options beyond torch.optim.Muon's, grouped by concern.

``Muon(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
ns_steps, adjust_lr_fn)`` takes torch.optim.Muon's parameters; the rest come
either as one option object per concern::

    Muon(params, lr=3e-3, newton_schulz=NewtonSchulzOptions(ns_algorithm="gram"),
         placement=PlacementOptions(gtp_size=2, tp_size=2),
         connection=ConnectionOptions(daemons=addresses, job_id="job"))

or as the flat keywords of the same names (``Muon(..., ns_algorithm="gram",
gtp_size=2, ...)``; AdamWOptions.eps is the flat ``adamw_eps``). Both forms
give the same optimizer; a flat keyword given together with the object of
its concern is refused, naming the keyword. The defaults are the flat
keywords' (torch's where torch has the option). The seed API's options of
other names (tp_mode, process groups, ...) are accepted at the
value that is muond's behaviour or refused with the reason (seed_options)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from muond import _rules
from muond.torch.seed_options import SEED_ONLY, check_seed_options


@dataclass(frozen=True)
class NewtonSchulzOptions:
    """How the orthogonalisation runs. ``coefficient_type``: muond's named
    coefficient sets (None: torch's "simple" triple, or ``ns_coefficients``);
    ``fp32_matmul_prec``: "medium" (bf16 operands, torch's) or "highest"
    (fp32); ``ns_algorithm``: "auto" (Gram NS where it is faster, under
    "medium"; standard NS otherwise), "standard" or "gram" (with
    ``gram_restarts``, ``gram_dtype``, ``gram_min_aspect_ratio``); ``split_qkv`` with
    ``is_qkv_fn``, ``qkv_split_shapes`` and ``qkv_head_dim``: Q, K and V (or
    every head) of fused QKV params orthogonalised apart (muond.qkv_split)."""
    coefficient_type: str | None = None
    # Same-shape matrices per NS batch; 0 = auto (by shape: batched where the
    # short side is <= 2048, one at a time above); 1 = bit-exact numerics.
    ns_batch_size: int = 0
    fp32_matmul_prec: str = "medium"
    use_syrk: bool = False
    ns_algorithm: str = _rules.DEFAULT_NS_ALGORITHM  # the daemon's NsOptions default
    gram_restarts: object = None
    gram_dtype: str = _rules.DEFAULT_GRAM_DTYPE
    gram_min_aspect_ratio: float | None = None
    # The seed API's split QKV (muond.qkv_split): constructor-wide, as there;
    # never in param_groups (is_qkv_fn is a function a state dict cannot hold).
    split_qkv: bool = False
    is_qkv_fn: object = None
    qkv_split_shapes: object = None
    qkv_head_dim: int | None = None


@dataclass(frozen=True)
class ScalingOptions:
    """How the update is scaled and weight decay applied (None: from
    torch's ``adjust_lr_fn``), and the Muon variant that renormalises the
    Newton-Schulz output with a second moment before the scale: ``variant``
    "muon" (none), "normuon" (per row, dion's NorMuon) or "adamuon"
    (elementwise, Emerging-Optimizers' AdaMuon), with its decay ``beta2``
    and ``moment2_eps`` (fixed at registration; muond.torch.variants)."""
    scale_mode: str | None = None
    extra_scale_factor: float | None = None
    weight_decay_method: str = "decoupled"
    variant: str = "muon"
    beta2: float = 0.95
    moment2_eps: float = 1e-8


@dataclass(frozen=True)
class AdamWOptions:
    """The defaults of ``"algorithm": "adamw"`` groups (flat: ``betas``,
    ``adamw_eps``)."""
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8


@dataclass(frozen=True)
class StateStorageOptions:
    """Where and in what precision the daemons keep each group's optimizer
    state (Muon momentum, AdamW moments; per group too, as param group keys):
    ``state_dtype`` "auto" (torch's rule: bf16 for a group whose params are
    all bf16, else fp32), "fp32", "bf16" or "fp8_e4m3" (blockwise scaled,
    torchao's fp8 optimizers); ``state_location`` "device" (GPU memory) or
    "host" (pinned host memory the GPU reads in place). Fixed at
    registration; a state dict moves between them (muond.torch.state_storage).
    ``double_buffer_momentum`` (Muon groups): a second momentum buffer, so
    the momentum is computed once a step instead of again at its commit (one
    pass over grad and momentum less a step, one momentum's memory more; the
    same updates and state bit for bit)."""
    state_dtype: str = "auto"
    state_location: str = "device"
    double_buffer_momentum: bool = False


@dataclass(frozen=True)
class PlacementOptions:
    """Where the params go: ``shard_mode`` "split" (one trainer over
    gtp_size x tp_size daemons) or "local" (one trainer per daemon; the
    default without daemons=), the domain and this trainer's coordinates."""
    shard_mode: str | None = None
    gtp_size: int = 1
    tp_size: int = 1
    g: int = 0
    t: int = 0
    domain_name: str = "dense"
    dp_size: int | None = None
    dp_rank: int | None = None


@dataclass(frozen=True)
class ConnectionOptions:
    """The daemons and how to talk to them (``daemons`` empty: this rank's
    daemon from the environment, muond.torch.discovery). ``step_channel``:
    with one daemon (a torchrun rank's), steps go through shared memory
    instead of the Step RPC (muond.step_channel: the same answers, without
    gRPC's wake-ups after a step's idling), where the daemon offers it.
    ``overlap_checks``: through such a channel, the usual step is sent before
    step()'s checks of the params and grads, which run while the daemon runs
    it; the daemon commits it only once they pass (a step that needs a grad
    copied in, or that a check refuses, is withdrawn on every rank and sent
    again after the checks, or refused, as without it).
    ``step_channel_poll_ms``: with CUDA params, through such a channel, the
    trainer polls for the daemon's answer over the last this many ms before
    it expects it (the last step's wait) and as long after, instead of
    sleeping: awake when the answer comes (muond.step_channel
    StepChannel.set_answer_poll; up to twice this of one core a step).
    0 to 100; 0: sleeps throughout."""
    daemons: object = ()
    job_id: str | None = None
    client_id: str | None = None
    wait_healthy_timeout: float = 30.0
    rpc_timeout: float | None = 300.0
    first_step_id: int = 1
    token: str | None = None
    token_file: object = None
    tls_root_certificates: object = None
    takeover: bool = False
    step_channel: bool = True
    overlap_checks: bool = True
    step_channel_poll_ms: float = 1.0


# Muon's keyword for each option object.
OPTION_KEYWORDS = {
    "newton_schulz": NewtonSchulzOptions,
    "scaling": ScalingOptions,
    "adamw": AdamWOptions,
    "state_storage": StateStorageOptions,
    "placement": PlacementOptions,
    "connection": ConnectionOptions,
}
# Fields whose flat keyword has another name.
_FLAT_NAMES = {(AdamWOptions, "eps"): "adamw_eps"}


def flat_name(cls, field_name: str) -> str:
    return _FLAT_NAMES.get((cls, field_name), field_name)


FLAT_KEYWORDS = tuple(flat_name(cls, f.name) for cls in OPTION_KEYWORDS.values()
                      for f in fields(cls))


def resolve(flat: dict, objects: dict) -> dict:
    """Every flat keyword's value: given flat, else from its concern's
    option object, else the default. ``flat``: the flat keywords given;
    ``objects``: option keyword -> object or None. TypeError for an unknown
    keyword (Python's own message) or an object of the wrong class;
    ValueError when a flat keyword and its concern's object are both given,
    or for a seed option muond refuses (seed_options)."""
    seed = {k: v for k, v in flat.items() if k in SEED_ONLY}
    flat = {k: v for k, v in flat.items() if k not in SEED_ONLY}
    for key in flat:
        if key not in FLAT_KEYWORDS:
            raise TypeError(f"Muon.__init__() got an unexpected keyword argument {key!r}")
    out = {}
    for keyword, cls in OPTION_KEYWORDS.items():
        given = objects.get(keyword)
        if given is not None and not isinstance(given, cls):
            raise TypeError(f"{keyword}= must be a muond.torch.{cls.__name__}, got "
                            f"{type(given).__name__}")
        for f in fields(cls):
            name = flat_name(cls, f.name)
            if name in flat and given is not None:
                raise ValueError(f"give {name}= or {keyword}={cls.__name__}"
                                 f"({f.name}=...), not both")
            if name in flat:
                out[name] = flat[name]
            else:
                out[name] = getattr(given, f.name) if given is not None else f.default
    check_seed_options(seed, out)
    return out
