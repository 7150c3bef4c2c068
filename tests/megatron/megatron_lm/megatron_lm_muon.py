"""Megatron-LM's own LayerShardedMuon as the reference muond.megatron is run
against: ``megatron/core/optimizer/layer_sharded_muon.py`` and
``layer_sharded_a2a.py`` of a Megatron-LM checkout that has them, loaded onto
the installed megatron-core 0.19.2 (which does not ship them) unchanged.

``installed(checkout)`` makes Megatron-Core's optimizer factory build that
class for its ``"muon"`` entry, as Megatron-LM's ``use_layer_sharding_muon`` does;
``assign_ns_homes(optimizer)`` then gives every Muon matrix its NS home over
the TP group, longest-processing-time first by NS cost, as Megatron-LM's
layer-wise optimizer does (GTP is 1 here: megatron-core 0.19.2's models have
no GTP weight sharding).

What 0.19.2 lacks and the checkout's class needs, bridged without changing
any arithmetic: ``megatron.core.utils.is_emerging_optimizers_min_version``,
and ``use_syrk=`` on TensorParallelMuon's constructor (0.19.2 has no SYRK
path: only ``use_syrk=False`` is accepted).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys

from packaging.version import Version

_MODULES = ("layer_sharded_a2a", "layer_sharded_muon")


def is_emerging_optimizers_min_version(version, check_equality=True):
    """Megatron-LM's helper of that name, which megatron-core 0.19.2 lacks."""
    have = Version(importlib.metadata.version("emerging-optimizers"))
    return have >= Version(version) if check_equality else have > Version(version)


def _load(checkout: str, name: str):
    path = os.path.join(checkout, "megatron", "core", "optimizer", name + ".py")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: not a Megatron-LM checkout with layer-sharded Muon "
            "(NVIDIA/Megatron-LM pull request 6683 and later)")
    qualified = "megatron.core.optimizer." + name
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def load_layer_sharded_muon(checkout: str) -> type:
    """The checkout's LayerShardedMuon class, importable as
    ``megatron.core.optimizer.layer_sharded_muon``."""
    import megatron.core.utils as mcu
    from megatron.core.optimizer import emerging_optimizers as eo

    if not hasattr(mcu, "is_emerging_optimizers_min_version"):
        mcu.is_emerging_optimizers_min_version = is_emerging_optimizers_min_version
    base = eo.TensorParallelMuon

    class TensorParallelMuon(base):  # accepts the checkout's use_syrk=
        def __init__(self, *args, use_syrk: bool = False, **kwargs):
            if use_syrk:
                raise ValueError("megatron-core 0.19.2 has no SYRK Newton-Schulz")
            super().__init__(*args, **kwargs)

    eo.TensorParallelMuon = TensorParallelMuon
    try:
        module = None
        for name in _MODULES:
            module = _load(checkout, name)
    finally:
        eo.TensorParallelMuon = base
    return module.LayerShardedMuon


@contextlib.contextmanager
def installed(checkout: str):
    """While open, Megatron-Core's ``"muon"`` factory entry builds the
    checkout's LayerShardedMuon (a GTP group of one rank, the TP group from
    the factory's pg_collection); the entry as it was after. Collective:
    every rank enters it. Yields the class."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.optimizer import emerging_optimizers as eo

    cls = load_layer_sharded_muon(checkout)
    tp_kwargs = eo._muon_config_to_kwargs
    # Its exchanges pass gtp_group to torch's collectives, where None would
    # be the whole world: GTP 1 is a group of this rank alone.
    gtp_group, _ = dist.new_subgroups(group_size=1)

    def config_to_kwargs(config, model_chunks, pg_collection):
        kwargs = tp_kwargs(config, model_chunks, pg_collection)
        kwargs["gtp_group"] = gtp_group
        kwargs["tp_group"] = getattr(pg_collection, "tp", None)
        return kwargs

    entry = eo._EMERGING_OPTIMIZERS["muon"]
    eo._EMERGING_OPTIMIZERS["muon"] = dataclasses.replace(
        entry, optimizer_cls=cls, config_to_kwargs=config_to_kwargs)
    try:
        yield cls
    finally:
        eo._EMERGING_OPTIMIZERS["muon"] = entry


def _full_shape(p, tp_size: int) -> tuple:
    shape = list(p.shape)
    dim = getattr(p, "partition_dim", -1)
    if getattr(p, "tensor_model_parallel", False) and dim in (0, 1):
        shape[dim] *= tp_size
    return tuple(shape)


def assign_ns_homes(optimizer) -> int:
    """Gives each Muon matrix of every LayerShardedMuon inside ``optimizer``
    (Megatron's chained optimizer) an NS home (0, t) over the TP group:
    longest NS cost first to the least-loaded TP rank (ties: lowest rank).
    Every TP rank computes the same table. Returns how many were assigned."""
    import torch.distributed as dist

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    assigned = 0
    for part in parts:
        inner = getattr(part, "optimizer", part)
        if not hasattr(inner, "set_param_ns_homes"):
            continue
        tp = inner.tp_group
        tp_size = dist.get_world_size(tp) if tp is not None else 1
        load = [0] * tp_size
        params = [p for g in inner.param_groups for p in g["params"]]
        costs = []
        for index, p in enumerate(params):
            m, n = _full_shape(p, tp_size)[-2:]
            costs.append((-(m * n * min(m, n)), index))
        homes = {}
        for _, index in sorted(costs):
            t = min(range(tp_size), key=lambda r: (load[r], r))
            m, n = _full_shape(params[index], tp_size)[-2:]
            load[t] += m * n * min(m, n)
            homes[id(params[index])] = (0, t)
        inner.set_param_ns_homes(homes)
        assigned += len(homes)
    return assigned
