"""pytest plugin: Megatron-LM's own unit tests for layer-sharded Muon
(tests/unit_tests/optimizer/test_layer_sharded_*.py of a Megatron-LM checkout)
run against muond's adapter, muond.megatron.LayerShardedMuon, on CPU under
gloo with megatron-core 0.19.2. run_megatron_lm_tests.sh copies it next to
the checkout's tests; docs/megatron.md lists what ran and why the rest did
not.

* ``megatron.core.optimizer.layer_sharded_muon`` is muond's class, with the
  keyword of earlier revisions (``gtp_group=``) and ``fused_group=`` (a
  communication pattern: muond's daemons route the shards) accepted.
* ``megatron.core.optimizer.layer_sharded_a2a``: Megatron's private
  all-to-all primitives, not the adapter's API: a test calling one is
  skipped as not applicable.
* Megatron-LM's ``Utils`` initialises gloo from torchrun's environment.
"""
import datetime
import os
import sys
import types
import typing

import typing_extensions

if not hasattr(typing, "override"):  # emerging-optimizers 0.3 on Python 3.11
    typing.override = typing_extensions.override

import pytest
import torch
import torch.distributed as dist

import megatron.core.utils as mcu
from megatron.core.optimizer import emerging_optimizers as eo_mod
from megatron_lm_muon import is_emerging_optimizers_min_version
from muond.megatron import LayerShardedMuon as _MuondLayerShardedMuon


# -- megatron-core 0.19.2 lacks this helper the tests import ------------------------
mcu.is_emerging_optimizers_min_version = is_emerging_optimizers_min_version
eo_mod.is_emerging_optimizers_min_version = is_emerging_optimizers_min_version


# -- the alias: Megatron's module path -> muond's adapter ---------------------------
class LayerShardedMuon(_MuondLayerShardedMuon):
    """(a) the old keyword gtp_group= is the new gtp_remat_group=;
    (b) fused_group= (the seed's choice of one fused all-to-all vs two stages) is a
    communication pattern only: muond's daemons route the shards themselves, so it is
    dropped, as is the third (fused) entry of set_group_process_groups' tuples.
    muond's connection keywords come from `muond launch`'s environment (discovery)."""

    def __init__(self, params, *args, gtp_group=None, fused_group=None, **kwargs):
        if gtp_group is not None:
            kwargs.setdefault("gtp_remat_group", gtp_group)
        super().__init__(params, *args, **kwargs)
        if os.environ.get("MLM_TAG_TP", "1") == "1":
            # (c) the seed reads partition_dim alone as "TP-sharded"; muond needs
            # tensor_model_parallel=True too (Megatron stamps partition_dim on
            # duplicated weights). Tag what the tests tagged with partition_dim only.
            for group in self.param_groups:
                for p in group["params"]:
                    if getattr(p, "partition_dim", None) in (0, 1) and not hasattr(
                            p, "tensor_model_parallel"):
                        p.tensor_model_parallel = True

    def set_group_process_groups(self, group_process_groups):
        if isinstance(group_process_groups, dict):
            group_process_groups = {
                k: (tuple(v)[:2] if isinstance(v, (tuple, list)) and len(v) == 3 else v)
                for k, v in group_process_groups.items()}
        return super().set_group_process_groups(group_process_groups)


_lsm = types.ModuleType("megatron.core.optimizer.layer_sharded_muon")
_lsm.LayerShardedMuon = LayerShardedMuon
_lsm.is_emerging_optimizers_min_version = is_emerging_optimizers_min_version
sys.modules[_lsm.__name__] = _lsm


# Megatron's private all-to-all primitives: not part of the adapter. A stand-in module so
# test_layer_sharded_muon.py imports; a test that calls one is skipped as N/A.
def _na_primitive(*args, **kwargs):
    pytest.skip("N/A: Megatron-private layer_sharded_a2a primitive (muond's daemons route)")


_a2a = types.ModuleType("megatron.core.optimizer.layer_sharded_a2a")
for _name in ("layer_sharded_all_to_all_fwd", "layer_sharded_all_to_all_bwd",
              "route_to_ns_home", "route_from_ns_home"):
    setattr(_a2a, _name, _na_primitive)
sys.modules[_a2a.__name__] = _a2a


# -- Utils on CPU: gloo, torchrun's env:// rendezvous, no torch.cuda.set_device ------
from tests.unit_tests.test_utilities import Utils  # noqa: E402


def _initialize_distributed_gloo():
    if not dist.is_initialized() and Utils.rank >= 0:
        dist.init_process_group(backend="gloo", init_method="env://",
                                world_size=Utils.world_size, rank=Utils.rank,
                                timeout=datetime.timedelta(minutes=2))
        dist.barrier()
    Utils.inited = True


Utils.initialize_distributed = staticmethod(_initialize_distributed_gloo)
