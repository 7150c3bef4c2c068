"""``opt.state`` as torch.optim has it, read from the daemons when first
used and cached until the state changes; every change reaches the daemons
before the next step."""
from __future__ import annotations

import weakref
from collections.abc import MutableMapping

import torch

from muond import state as _state


class ParamState(dict):
    """One param's entry of ``opt.state``: assigning a key (``opt.state[p]
    ["momentum_buffer"] = t``) marks the state for import before the next
    step, as assigning the whole entry does."""

    def __init__(self, values: dict, owner: "LazyState"):
        super().__init__(values)
        self._owner = weakref.ref(owner)  # the owner caches this entry: no cycle

    def _mark_dirty(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner._dirty = True

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._mark_dirty()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._mark_dirty()


class LazyState(MutableMapping):
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
        # A weak reference: opt.state -> opt would be a reference cycle, and
        # an optimizer in a cycle outlives `del opt` (its finalizer waits for
        # the cyclic garbage collector).
        self._opt_ref = weakref.ref(opt)
        self._cache = None
        self._dirty = False
        self._versions: list = []  # (fetched tensor, its _version when fetched)

    @property
    def _opt(self) -> "Muon":
        return self._opt_ref()

    def _params(self):
        return [p for group in self._opt.param_groups for p in group["params"]]

    def _loaded(self) -> dict:
        if self._cache is None:
            fetched = self._opt._fetch_state()
            self._cache = {p: ParamState(s, self) for p, s in fetched.items()}
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
        self._loaded()[p] = ParamState(value, self)
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

    def cached(self) -> bool:
        """A fetched state is held here (push_if_assigned may have to push it)."""
        return self._cache is not None

    def push_if_assigned(self) -> None:
        """Imports the cached state into the daemons when it was changed
        (assigned, or a fetched tensor edited in place)."""
        if self._cache is None or not self._changed():
            return
        opt = self._opt
        states = _state.validate(opt._param_infos(),
                                 {opt._param_names[id(p)]: s for p, s in self._cache.items()})
        opt._push_state(states, opt.step_id)

