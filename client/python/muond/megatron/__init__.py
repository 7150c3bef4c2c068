"""muond for Megatron-LM users (docs/megatron.md).

* ``LayerShardedMuon``: Megatron-Core's LayerShardedMuon constructor
  (the same argument names, defaults and meanings, but ``ns_batch_size``
  defaults to muond's 0, auto) stepping on muond
  daemons; reads ``main_grad``; registers at its first step, after
  Megatron's mixed-precision wrapper swapped in its fp32 main params.
* ``get_megatron_optimizer``: Megatron-Core's factory (same arguments)
  returning Megatron's chained Muon + AdamW optimizer, its Muon part
  muond's: the one-line change from ``megatron.core.optimizer``.

Megatron-Core itself is needed only for ``get_megatron_optimizer``.
"""
from muond.megatron.factory import get_megatron_optimizer
from muond.megatron.optimizer import LayerShardedMuon, tp_partition_dim

__all__ = ["LayerShardedMuon", "get_megatron_optimizer", "tp_partition_dim"]
