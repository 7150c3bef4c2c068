"""``muond.megatron.get_megatron_optimizer``: Megatron-Core's optimizer
factory with muond's LayerShardedMuon as its Muon.

Megatron-Core builds Muon through its emerging-optimizer registry
(``megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS``, the
extension point its module docstring documents): the entry names the
optimizer class, how OptimizerConfig becomes its keywords and how its state
is created for a checkpoint. This factory puts muond's class in the "muon"
entry for the one call, so everything else is Megatron's own: the split of
params into Muon (2-D, not embedding or output) and AdamW groups, the
mixed-precision wrapper (fp32 main params, main_grad, grad norm, clipping,
``step()``'s (success, grad_norm, num_zeros)), the ChainedOptimizer, and
``sharded_state_dict`` / ``load_state_dict`` for dist_checkpointing.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

from muond.megatron.optimizer import LayerShardedMuon

_REGISTRY_LOCK = threading.Lock()  # the registry is module state: one swap at a time
_MUON_NAMES = ("muon", "dist_muon")


def _state_lives_in_daemons(optimizer, config=None) -> None:
    """Megatron's init_state_fn creates empty state before a checkpoint is
    loaded; muond's daemons hold every param's state from registration on,
    so there is nothing to create."""
    del optimizer, config


def _config_to_kwargs(config, model_chunks, pg_collection, *, megatron_kwargs, muond_options,
                      built: list):
    """LayerShardedMuon's keywords from OptimizerConfig: Megatron's own
    mapping for TensorParallelMuon (the seed's names), the seed-only
    options OptimizerConfig may carry, then the caller's muond options.
    Megatron builds one Muon per bucket (dense, expert-parallel): from the
    second on, a given ``name`` gets the bucket's number (one optimizer
    instance name per Muon, the same on every rank: the buckets come in the
    same order everywhere). ``built`` counts the calls."""
    kwargs = megatron_kwargs(config, model_chunks, pg_collection)
    for name in ("ns_batch_size", "use_syrk"):
        if hasattr(config, f"muon_{name}"):
            kwargs[name] = getattr(config, f"muon_{name}")
    kwargs.update(muond_options)
    if built and kwargs.get("name") is not None:
        kwargs["name"] = f"{kwargs['name']}-{len(built)}"
    built.append(kwargs.get("name"))
    return kwargs


def _register_muon_parts(optimizer) -> None:
    """Registers every muond Muon of Megatron's optimizer now, in the
    factory (Megatron's mixed-precision wrapper has swapped in its main
    params by then): every rank registers together and a refusal reaches
    all of them before any step, so no step is half applied because a later
    part was refused at its first use."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    muons = [part.optimizer for part in parts
             if isinstance(getattr(part, "optimizer", None), LayerShardedMuon)]
    try:
        for muon in muons:
            muon._ensure_registered()  # noqa: SLF001 (the first use, here)
    except BaseException:
        for muon in muons:  # none stays registered: a retry may take the same names
            muon.close()
        raise


def _check_config(config) -> None:
    if config.optimizer == "dist_muon" or getattr(
            config, "use_layer_wise_distributed_optimizer", False):
        raise ValueError("muond.megatron.get_megatron_optimizer: the layer-wise distributed "
                         "optimizer (optimizer='dist_muon' or "
                         "use_layer_wise_distributed_optimizer=True) shards Muon's params over "
                         "DP ranks itself; muond's daemons already shard Muon's work over the "
                         "whole job: use optimizer='muon' without it")


def get_megatron_optimizer(config, model_chunks, config_overrides=None,
                           use_gloo_process_groups: bool = True, pg_collection=None,
                           dump_param_to_param_group_map=None, **muond_options):
    """``megatron.core.optimizer.get_megatron_optimizer`` with the same
    arguments, its Muon groups stepped by muond (module docstring); any
    optimizer other than Muon is Megatron's call unchanged. The
    returned optimizer is Megatron's (a ChainedOptimizer of the Muon part
    and Megatron's Adam part). ``muond_options``: muond.torch.Muon's
    keywords (daemons, job_id, state_dtype, name, ...) for the Muon part."""
    from megatron.core import optimizer as mcore_optimizer  # noqa: PLC0415 (optional)
    from megatron.core.optimizer import emerging_optimizers as registry  # noqa: PLC0415

    if config.optimizer not in _MUON_NAMES:
        # A drop-in import: a script choosing its optimizer by flag keeps working.
        return mcore_optimizer.get_megatron_optimizer(
            config, model_chunks, config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map)
    _check_config(config)
    entries = registry._EMERGING_OPTIMIZERS  # noqa: SLF001 (Megatron's extension point)
    with _REGISTRY_LOCK:
        megatron_entry = entries["muon"]
        entries["muon"] = dataclasses.replace(
            megatron_entry, optimizer_cls=LayerShardedMuon,
            init_state_fn=_state_lives_in_daemons,
            config_to_kwargs=functools.partial(
                _config_to_kwargs, megatron_kwargs=megatron_entry.config_to_kwargs,
                muond_options=muond_options, built=[]))
        try:
            optimizer = mcore_optimizer.get_megatron_optimizer(
                config, model_chunks, config_overrides=config_overrides,
                use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
                dump_param_to_param_group_map=dump_param_to_param_group_map)
        finally:
            entries["muon"] = megatron_entry
    _register_muon_parts(optimizer)
    return optimizer
