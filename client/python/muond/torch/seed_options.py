"""The options of the seed API (Megatron-Core's LayerShardedMuon and its
parent TensorParallelMuon from Emerging-Optimizers) that muond.torch.Muon
does not take under the same name: each is either accepted with the one value
that is muond's behaviour, or refused at construction naming the option, the
value and the reason. docs/seed-options.md lists every seed option with what
muond does with it; a test keeps that table and ``SEED_ONLY`` in step.

Options muond takes under the seed's own name (lr, momentum, weight_decay,
nesterov, fp32_matmul_prec, coefficient_type, scale_mode,
extra_scale_factor, ns_batch_size, use_syrk, split_qkv, is_qkv_fn,
qkv_split_shapes) are ordinary keywords
(muond.torch.options) and not listed here."""
from __future__ import annotations

_GROUPS_REASON = (
    "muond reads each param's layout from its DTensor placements, its Megatron tags "
    "(tensor_model_parallel, partition_dim, is_gtp_weight_remat) or gtp_size=/tp_size=/g=/t=, "
    "and its daemons own the communicators: pass those instead of process groups")


def _none_only(reason: str):
    def check(value, _given) -> str | None:
        return None if value is None else reason
    return check


def _tp_mode(value, _given) -> str | None:
    if value in ("duplicated", "distributed", "auto"):
        return None  # one full-matrix NS per matrix: duplicated's result
    if value == "blockwise":
        return ("blockwise orthogonalises each TP shard on its own, a different update; "
                "muond runs every matrix's Newton-Schulz on the full matrix once "
                "(duplicated's result, bitwise with ns_batch_size=1)")
    return "the seed's values are 'blockwise', 'duplicated', 'distributed' and 'auto'"


def _concurrent_groups(value, _given) -> str | None:
    if value is True:
        return None  # the daemon's lanes run groups of disjoint domains at once
    return ("the daemon always runs the groups of disjoint domains concurrently (its "
            "lanes) and serialises those sharing a domain; there is no serial mode")


def _decoupled(value, given) -> str | None:
    if value is True:
        method = given.get("weight_decay_method", "decoupled")
        return None if method == "decoupled" else (
            f"it contradicts weight_decay_method={method!r}; give one of them")
    return ("L2 weight decay (added to the gradient) is not offered; muond's "
            "weight_decay_method is one of 'decoupled' (the seed's True), 'independent', "
            "'cautious' or 'none'")


def _renamed(muond_name: str):
    def check(_value, _given) -> str | None:
        return f"muond.torch.Muon takes torch.optim.Muon's name for it: {muond_name}="
    return check


# seed option -> check(value, every flat keyword given) -> None (accepted) or
# the reason it is refused.
SEED_ONLY = {
    "num_ns_steps": _renamed("ns_steps"),
    "gtp_remat_group": _none_only(_GROUPS_REASON),
    "tp_group": _none_only(_GROUPS_REASON),
    "pg_collection": _none_only(_GROUPS_REASON),
    "concurrent_groups": _concurrent_groups,
    "use_decoupled_weight_decay": _decoupled,
    "tp_mode": _tp_mode,
}


def _shown(value) -> str:
    """The value as the user wrote it, or its type for an object (a process
    group's repr says little and may be long)."""
    if value is None or isinstance(value, (bool, int, float, str, list, tuple)):
        return repr(value)
    return f"<{type(value).__name__}>"


def check_seed_options(seed: dict, resolved: dict) -> None:
    """ValueError naming the first refused seed option in ``seed`` (seed
    option -> value), its value and the reason; ``resolved``: every muond
    keyword's value (weight_decay_method's, for use_decoupled_weight_decay)."""
    for name, value in seed.items():
        reason = SEED_ONLY[name](value, resolved)
        if reason is not None:
            raise ValueError(f"{name}={_shown(value)} (an option of Megatron's LayerShardedMuon): "
                             f"{reason} (docs/seed-options.md)")
