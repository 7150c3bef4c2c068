"""Param groups: torch.optim's keys as muond's options and back, the checks
a group passes before any daemon sees it, and which entries are live (sent
with every Step) or fixed at registration."""
from __future__ import annotations

import functools
import itertools
import math
import operator

import numpy as np
import torch

from muond import _rules
from muond import batched as _batched
from muond import state as _state
from muond.torch import state_storage as _state_storage
from muond.torch import variants as _variants
from muond.torch import wire as _wire
from muond.v1 import muond_pb2 as pb


def scale_from_adjust_lr_fn(adjust_lr_fn, scale_mode, extra_scale_factor):
    """torch.optim.Muon's adjust_lr_fn as muond's scale mode:
    None/"original": lr * sqrt(max(1, A/B)) = "shape_scaling" x 1;
    "match_rms_adamw": lr * 0.2 * sqrt(max(A, B)) = "spectral" x 0.2.
    An explicit scale_mode / extra_scale_factor wins."""
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r} not in (None, 'original', "
                         "'match_rms_adamw')")
    mode, extra = (("spectral", _rules.MATCH_RMS_ADAMW_EXTRA_SCALE)
                   if adjust_lr_fn == "match_rms_adamw"
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
PARAM_KEYS = ("params", "param_names")

# torch.optim.AdamW options an "adamw" group may carry: the value muond
# computes with (anything else is refused at construction). foreach and fused
# choose torch's kernels, not the math: accepted, ignored (the daemon has its
# own kernels).
ADAMW_FIXED_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False,
                        "differentiable": False, "decoupled_weight_decay": True}


# Their AdamW keys that choose torch's kernels, not the math: carried in the
# groups (a state dict round-trips through torch.optim.AdamW), never fixed.
KERNEL_KEYS = ("foreach", "fused")
# How the step is scheduled, not what it computes (Newton-Schulz's products
# batched or on their lower triangle, the momentum stored once or recomputed;
# the state does not depend on it): a loaded state dict's value gives way to
# this optimizer's, so a checkpoint from before auto batching (every group
# saved ns_batch_size 1) resumes in an optimizer at the defaults, and back.
SCHEDULING_KEYS = ("ns_batch_size", "use_syrk", "double_buffer_momentum")
# torch.optim.Muon's default ns_coefficients: muond's coefficient_type "simple"
# (core/muon/coefficients.h, through the generated muond._rules).
_SIMPLE_COEFFICIENTS = _rules.SIMPLE_COEFFICIENTS


def from_torch_keys(group: dict) -> dict:
    """A user's Muon group dict with torch.optim.Muon's per-group
    ns_coefficients / adjust_lr_fn (and not muond's own coefficient_type /
    scale_mode): those as muond's options, so the group computes with them."""
    if group.get("algorithm", "muon") != "muon":
        return group
    group = dict(group)
    if "ns_coefficients" in group and "coefficient_type" not in group:
        group["coefficient_type"], group["custom_coefficients"] = coefficients_from_torch(
            group["ns_coefficients"])
    if "adjust_lr_fn" in group and "scale_mode" not in group:
        group["scale_mode"], group["extra_scale_factor"] = scale_from_adjust_lr_fn(
            group["adjust_lr_fn"], None, None)
    return group


def coefficients_from_torch(ns_coefficients):
    """torch.optim.Muon's ns_coefficients (one triple or a sequence of
    triples) as muond's ("custom", flat list of floats)."""
    flat = list(ns_coefficients)
    return "custom", [float(c) for c in (sum(map(list, flat), []) if flat and
                                         isinstance(flat[0], (tuple, list)) else flat)]


def with_torch_keys(group: dict) -> None:
    """Gives a group the keys torch.optim.Muon / torch.optim.AdamW read, with
    the values muond computes with, so that its state dict loads into them
    (and theirs into muond: loaded_options compares them)."""
    if group["algorithm"] == "adamw":
        for key, value in {**ADAMW_FIXED_OPTIONS, "foreach": None, "fused": None}.items():
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
    elif scale == ("spectral", _rules.MATCH_RMS_ADAMW_EXTRA_SCALE):
        group["adjust_lr_fn"] = "match_rms_adamw"
    else:  # no torch equivalent: says so (torch would scale by 1.0)
        group["adjust_lr_fn"] = f"muond:{scale[0]}x{scale[1]}"


def check_adamw_options(gi: int, group: dict) -> None:
    for key, supported in ADAMW_FIXED_OPTIONS.items():
        if key in group and bool(group[key]) != supported:
            raise ValueError(f"param group {gi}: AdamW option {key}={group[key]!r} is not "
                             f"supported by muond (only {key}={supported})")


def check_adamw_keys(gi: int, group: dict) -> None:
    """An AdamW group as the user wrote it (before the optimizer's defaults,
    which are a Muon group's, fill it in) names no Muon variant option and
    no option of Muon's momentum."""
    given = [k for k in _variants.KEYS if k in group]
    if given:
        raise ValueError(f"param group {gi}: {given[0]!r} is an option of a Muon group's "
                         "variant (NorMuon/AdaMuon's second moment), not of AdamW, whose "
                         "are 'betas' and 'eps'")
    if "double_buffer_momentum" in group:
        raise ValueError(f"param group {gi}: 'double_buffer_momentum' is an option of a Muon "
                         "group's momentum, not of AdamW's moments (updated in place once "
                         "a step)")


def frozen(value):
    """A comparable copy of a group entry (tensors and lists compared by value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    if isinstance(value, np.ndarray):  # compared by value, and a copy: not the live array
        return ("tensor", tuple(value.reshape(-1).tolist()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


def thawed(value):
    """A frozen entry as the user wrote it, for messages (lists, not tuples)."""
    if isinstance(value, tuple) and value[:1] == ("tensor",) and len(value) == 2:
        return list(value[1])
    if isinstance(value, tuple):
        return [thawed(v) for v in value]
    return value


def fixed_entries(group: dict) -> "FixedEntries":
    return FixedEntries(group)


_MISSING = object()


# Exactly these types: a subclass may carry state that frozen() reads (a
# tuple's __iter__, a str's __eq__), so the same object may hold another value.
_IMMUTABLE_TYPES = (type(None), bool, int, float, str, bytes)


def _immutable(value) -> bool:
    """A value nothing can change in place, so that the same object still
    holds the same value (a tuple of such values included)."""
    if type(value) is tuple:
        return all(map(_immutable, value))
    return type(value) in _IMMUTABLE_TYPES


def _plain_or_immutable(value) -> bool:
    return _plain_list(value) or _immutable(value)


def _plain_list(value) -> bool:
    """A list of values nothing changes in place (custom_coefficients' usual
    form)."""
    return type(value) is list and all(map(_immutable, value))


class FixedEntries(dict):
    """A group's entries fixed at registration: key -> frozen value. It also
    keeps the registered objects of the entries nothing changes in place
    (numbers, strings, tuples of them), so that check_fixed tells an
    unchanged group by identity, one pass in C, instead of freezing and
    comparing every entry at every step (a thousand groups of ~20 entries
    each took ~6 ms a step)."""

    def __init__(self, group: dict):
        live = LIVE_KEYS[group["algorithm"]]
        super().__init__((k, frozen(v)) for k, v in group.items()
                         if k not in live and k not in PARAM_KEYS and k not in KERNEL_KEYS)
        self._same_keys = tuple(k for k in self if _immutable(group[k]))
        self._same_values = tuple(group[k] for k in self._same_keys)
        same = set(self._same_keys)
        self._compared = tuple(k for k in self if k not in same)
        # For UnchangedGroups: the entries compared by value that are plain
        # lists (their items compared by identity there), and whether any
        # other kind is compared (an array, a tensor: no flat test for it).
        self.list_keys = tuple(k for k in self._compared if _plain_list(group[k]))
        self.compared_other = len(self.list_keys) < len(self._compared)

    @property
    def same_keys(self) -> tuple:
        return self._same_keys

    def unchanged_in(self, group: dict) -> bool:
        """Every entry still holds its registered value in ``group`` (False
        may still be unchanged: check_fixed then compares entry by entry)."""
        now = map(group.get, self._same_keys, itertools.repeat(_MISSING))
        return (all(map(operator.is_, now, self._same_values))
                and all(k in group and frozen(group[k]) == self[k] for k in self._compared))


def group_label(gi: int, group: dict) -> str:
    return f"param group {gi} ({group.get('name', f'group{gi}')!r})"


def is_bool(value) -> bool:
    """A truth value in any of the forms a config or a tensor op gives one:
    Python bool, numpy bool_, a one-element bool tensor. The one rule for
    both kinds of option: a number refuses every one of them (True is not
    an lr of 1.0), a bool option accepts every one of them."""
    if isinstance(value, (bool, np.bool_)):
        return True
    return (isinstance(value, torch.Tensor) and value.dtype == torch.bool
            and value.numel() == 1)


def _kind(value) -> str:
    """The type of a refused value for its message; a bool says why it is
    no number (np.True_ would otherwise read as a number)."""
    if is_bool(value):
        return f"{type(value).__name__}, a bool: give the number itself"
    return type(value).__name__


def _real(label: str, key: str, value) -> float:
    """A live hyperparameter as the float the wire carries: a real number
    (int, float, numpy scalar, one-element tensor; no bool in any form
    (is_bool), None or str) and finite, else ValueError naming group and
    key. Its bounds (momentum < 1, ...) are the daemon's
    (core/muon/bounds.h): step() names them."""
    if type(value) is float and math.isfinite(value):  # the usual case, at every step
        return value
    ok = not isinstance(value, (str, bytes)) and value is not None and not is_bool(value)
    if ok and isinstance(value, torch.Tensor):
        ok = value.numel() == 1 and (value.is_floating_point() or not value.is_complex())
    try:
        number = float(value) if ok else None
    except (TypeError, ValueError, RuntimeError):
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{label}: {key!r} must be a finite real number, got {value!r} "
                         f"({_kind(value)})")
    return number


_INT32 = (-(1 << 31), (1 << 31) - 1)  # the wire's int32 fields


def _whole(label: str, key: str, value) -> int:
    """An integer hyperparameter (int or numpy int; no bool in any form,
    float or str) that fits the wire's int32, else ValueError naming group
    and key; its bounds are the daemon's."""
    if not is_bool(value):
        try:
            whole = operator.index(value)
        except TypeError:
            pass
        else:
            if not _INT32[0] <= whole <= _INT32[1]:
                raise ValueError(f"{label}: {key!r} is {whole}, past the int32 the daemons "
                                 f"take ([{_INT32[0]}, {_INT32[1]}]; the daemon's own bounds "
                                 "are narrower)")
            return whole
    hint = " (0 is auto)" if key == "ns_batch_size" else ""
    raise ValueError(f"{label}: {key!r} must be an int{hint}, got {value!r} ({_kind(value)})")


def _flag(label: str, key: str, value) -> bool:
    """A bool option as the bool the wire carries: any form is_bool accepts,
    or the int 0 or 1 (torch.optim takes them); else ValueError naming group
    and key."""
    if is_bool(value):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{label}: {key!r} must be a bool (True or False; a numpy bool_ or a "
                     f"one-element bool tensor too), got {value!r} ({type(value).__name__})")


# The numeric entries of a Muon group fixed at registration, by kind (the
# live ones are check_live's): checked at construction, like torch.optim's
# own (a str lr fails there), so the wire never meets a str or a bool.
_FIXED_REALS = ("eps", "extra_scale_factor")
_FIXED_INTS = ("ns_steps", "ns_batch_size")


# The types of a group's live entries (LIVE_KEYS' order) as the usual step
# finds them: finite floats and a bool pass check_live at once.
_USUAL_LIVE_TYPES = {"muon": [float, float, float, bool]}


def check_live(gi: int, group: dict) -> None:
    """The group's live entries (LIVE_KEYS) convert to what Step carries, or
    ValueError naming group and key (nothing sent)."""
    algorithm = group["algorithm"]
    usual = _USUAL_LIVE_TYPES.get(algorithm)
    if usual is not None:  # one pass in C at every step of every group
        values = list(map(group.get, LIVE_KEYS[algorithm]))
        if list(map(type, values)) == usual and all(map(math.isfinite, values)):
            return
    _check_live_entries(group_label(gi, group), group)


def _check_live_entries(label: str, group: dict) -> None:
    """check_live entry by entry, naming the first that fails."""
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
            _flag(label, key, value)
        else:
            _real(label, key, value)


def _sequence(value):
    """A list option's entries; None: none. (``value or ()`` would ask a
    numpy array or tensor of several entries for one truth value.)"""
    return () if value is None else value


def check_options(gi: int, group: dict) -> None:
    """Every hyperparameter of a group has a type the daemons compute with
    (check_live, then a Muon group's fixed numbers and Gram options), else
    ValueError naming group and key: at construction and add_param_group,
    before any daemon is waited for."""
    check_live(gi, group)
    _state_storage.check(group_label(gi, group), group)
    if group["algorithm"] != "muon":
        return
    label = group_label(gi, group)
    for key in _FIXED_REALS:
        if key in group:
            _real(label, key, group[key])
    for key in _FIXED_INTS:
        if key in group:
            _whole(label, key, group[key])
    for key in ("use_syrk", "double_buffer_momentum"):
        if key in group:
            _flag(label, key, group[key])
    for c in _sequence(group.get("custom_coefficients")):
        _real(label, "custom_coefficients", c)
    _variants.check(label, group)
    check_gram_options(gi, group)


class ParamsSeen:
    """The params lists check_before_step passed, per group: a group whose
    list holds the same tensors in the same order (one identity pass in C)
    was checked already, and is not walked param by param at every step. An
    entry holds only for the ``registered`` table it passed against (a
    re-registration builds a new one, whose entries only grow until the
    next) and says whether every param of the group is in the ``shared``
    set it passed with."""

    def __init__(self):
        self._groups: dict = {}  # group index -> (registered, params, shared, all in shared)

    def same(self, gi: int, params, registered: dict) -> bool:
        entry = self._groups.get(gi)
        return (entry is not None and entry[0] is registered and len(entry[1]) == len(params)
                and all(map(operator.is_, params, entry[1])))

    def all_shared(self, gi: int, shared) -> bool:
        """Every param of group gi (as ``same`` found it) is in ``shared``."""
        entry = self._groups[gi]
        return shared is not None and entry[2] is shared and entry[3]

    def passed(self, gi: int, params, registered: dict, shared) -> None:
        covered = shared is not None and all(id(p) in shared for p in params)
        self._groups[gi] = (registered, tuple(params), shared, covered)


class UnchangedGroups:
    """What check_before_step last passed, flattened over every group, so
    that a step whose groups hold exactly that (the same group dicts, the
    same objects in their fixed entries, their params lists and plain list
    entries, live entries still finite and of the types they had) passes in
    a few passes in C over the whole optimizer instead of a Python loop per
    group (~5 µs a group: a thousand groups cost ~5 ms a step). Anything
    else, or groups ``take`` could not flatten (an array or a tensor entry,
    a grad outside the shared buffers), is left to check_before_step, the
    one judge: this only recognises what it passed."""

    def __init__(self):
        self._taken = None

    def take(self, param_groups, fixed: dict, registered: dict, shared,
             grads_in_place: bool, group_params=None) -> None:
        """Records the groups check_before_step just passed (its arguments)."""
        self._taken = None
        try:
            self._taken = self._flatten(list(param_groups), fixed, registered, shared,
                                        grads_in_place, group_params)
        except (KeyError, TypeError, ValueError):  # an entry it cannot flatten
            self._taken = None

    @staticmethod
    def _flatten(groups, fixed, registered, shared, grads_in_place, group_params):
        entries = [fixed.get(gi) for gi in range(len(groups))]
        if (not grads_in_place or shared is None
                or any(f is None or f.compared_other for f in entries)):
            return None
        params = list(map(_PARAMS, groups))
        if not all(id(p) in shared for p in itertools.chain.from_iterable(params)):
            return None  # a grad that may be outside the shared buffers: checked each step
        # Identity tells an unchanged value only of one nothing changes in
        # place: a fixed entry that holds an equal list now (check_fixed
        # compares by value: ns_coefficients' tuple given as a list passes)
        # could be edited in place behind the same object, and a list entry
        # that is no plain list now (a UserList, a list of lists) iterates as
        # check_fixed does not compare. Such groups are checked each step.
        if not (all(map(_immutable, _flat([_getter(f.same_keys) for f in entries], groups)))
                and all(map(_plain_or_immutable,
                            _flat([_getter(f.list_keys) for f in entries], groups)))):
            return None
        # The params list and the list entries themselves too: one put in
        # their place is checked anew.
        same = [_getter(("params",) + f.same_keys + f.list_keys) for f in entries]
        # The params list and the plain lists (custom_coefficients), whose
        # items are compared by identity in one flat pass.
        lists = [_getter(("params",) + f.list_keys) for f in entries]
        live = [_live_getter(g["algorithm"]) for g in groups]
        live_types = list(map(type, _flat(live, groups)))
        if not set(live_types) <= {float, bool}:
            return None
        found = _flat(lists, groups)
        return dict(
            groups=groups, entries=entries, fixed=fixed, registered=registered,
            shared=shared, group_params=group_params, same=same, lists=lists, live=live,
            live_types=live_types,
            same_values=_flat(same, groups), list_lens=list(map(len, found)),
            list_items=list(itertools.chain.from_iterable(found)))

    def holds(self, param_groups, fixed: dict, registered: dict, shared,
              grads_in_place: bool, group_params=None) -> bool:
        """Every group still holds what ``take`` recorded (False: it may
        still pass; check_before_step tells)."""
        t = self._taken
        if (t is None or not grads_in_place or fixed is not t["fixed"]
                or registered is not t["registered"] or shared is not t["shared"]
                or group_params is not t["group_params"]
                or len(param_groups) != len(t["groups"])):
            return False
        groups = t["groups"]
        try:
            if not (all(map(operator.is_, param_groups, groups))
                    and all(map(operator.is_, map(fixed.get, range(len(groups))),
                                t["entries"]))
                    and _same_objects(_flat(t["same"], groups), t["same_values"])):
                return False
            found = _flat(t["lists"], groups)
            return (list(map(len, found)) == t["list_lens"]
                    and _same_objects(itertools.chain.from_iterable(found), t["list_items"])
                    and _finite_as_taken(_flat(t["live"], groups), t["live_types"]))
        except (KeyError, TypeError):  # an entry removed, a list made a number
            return False


_PARAMS = operator.itemgetter("params")


def _getter(keys: tuple):
    """group -> the tuple of its values at ``keys`` (KeyError where one is
    missing): one call in C for two keys or more."""
    if len(keys) >= 2:
        return operator.itemgetter(*keys)
    return lambda group: tuple(group[k] for k in keys)


def _live_getter(algorithm: str):
    """group -> its live entries as numbers (AdamW's betas unpacked)."""
    if algorithm == "adamw":
        get = operator.itemgetter("lr", "weight_decay", "eps", "betas")

        def adamw(group):
            lr, weight_decay, eps, betas = get(group)
            if type(betas) not in (tuple, list):
                # A generator or other iterable check_live refuses (it has no
                # len): unpacking it here would consume it, or never end.
                raise TypeError("betas: not a tuple or list")
            return (lr, weight_decay, eps, *betas)
        return adamw
    return _getter(LIVE_KEYS[algorithm])


def _flat(getters, groups) -> list:
    """Each getter's tuple from its group, one after the other."""
    return list(itertools.chain.from_iterable(
        map(lambda get, group: get(group), getters, groups)))


def _same_objects(now, then: list) -> bool:
    now = list(now)
    return len(now) == len(then) and all(map(operator.is_, now, then))


def _finite_as_taken(values: list, types: list) -> bool:
    """The live values have the (float or bool) types they had, and are
    finite: what check_live's one-pass acceptance asks."""
    return list(map(type, values)) == types and all(map(math.isfinite, values))


_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_NOT_NONE = functools.partial(operator.is_not, None)


def _grads_strided(params) -> bool:
    """No param of ``params`` has a grad of another layout than strided
    (one pass in C)."""
    grads = filter(_NOT_NONE, map(_GRAD, params))
    return all(map(operator.is_, map(_LAYOUT, grads), itertools.repeat(torch.strided)))


def check_before_step(param_groups, fixed: dict, registered: dict,
                      seen: ParamsSeen | None = None, shared=None,
                      grads_in_place: bool = False, group_params=None) -> None:
    """What step() checks before any grad is copied or RPC sent: no fixed
    entry changed (check_fixed), every live entry has its type (a str lr set
    by hand or a scheduler: check_live), every param is the tensor that was
    registered (``registered``: id -> wire name; a tensor put in its place
    in param_groups would silently not step) and every grad is dense.
    ``seen`` (ParamsSeen) keeps the params lists that passed: such a list is
    not walked again, and its grads are not looked at when every param is in
    ``shared`` (ids of the params whose grads live in shared buffers) and
    ``grads_in_place`` (each of those params' ``.grad`` is its shared
    buffer now: dense). ``group_params`` (per registered group, the ids of
    its params) also holds every group to the params it was registered with:
    a param moved to another group, or dropped from param_groups, would
    otherwise go on being stepped with its registered group's settings."""
    if group_params and len(param_groups) != len(group_params):
        raise ValueError(
            f"param_groups has {len(param_groups)} groups and {len(group_params)} were "
            "registered: a group added or removed by hand after construction is not "
            "followed (add_param_group adds one; build a new optimizer to drop one)")
    check_fixed(param_groups, fixed)
    for gi, group in enumerate(param_groups):
        check_live(gi, group)
        params = group["params"]
        if not isinstance(params, (list, tuple)):
            raise TypeError(
                f"param group {gi}: 'params' must be a list or tuple of tensors, as "
                f"torch.optim keeps it, not a {type(params).__name__} (it is read at every "
                "step)")
        if seen is not None and seen.same(gi, params, registered):
            if (grads_in_place and seen.all_shared(gi, shared)) or _grads_strided(params):
                continue
        names = param_names(gi, group)
        for j, p in enumerate(params):
            # Every param, named or not (a short param_names list must not
            # hide a foreign tensor from this check).
            name = names[j] if j < len(names) else f"#{j} of param group {gi}"
            if id(p) not in registered:
                raise ValueError(
                    f"param {name}: not the tensor registered in its place; a param "
                    "replaced in param_groups after registration is not followed (set "
                    "p.data to change a param's values; add_param_group for new params)")
            grad = p.grad
            if grad is not None and grad.layout != torch.strided:
                raise RuntimeError(
                    f"param {name}: its grad is sparse ({grad.layout}); muond's Muon and "
                    "AdamW need dense gradients (torch.optim.Muon and AdamW refuse sparse "
                    "ones too): build the module that makes it dense (nn.Embedding(..., "
                    "sparse=False), the default) or give that param to an optimizer that "
                    "takes sparse gradients (torch.optim.SparseAdam)")
        if group_params:
            _check_group_membership(gi, params, group_params[gi], registered)
        if seen is not None:
            seen.passed(gi, params, registered, shared)


def _check_group_membership(gi: int, params, registered_ids: frozenset,
                            registered: dict) -> None:
    """Group gi holds the params it was registered with (any order), else
    the ValueError naming the params that left it or came from another."""
    now = frozenset(map(id, params))
    if now == registered_ids:
        return
    came = sorted(registered[i] for i in now - registered_ids)
    left = sorted(registered[i] for i in registered_ids - now if i in registered)
    moves = "; ".join(part for part in (
        f"in it now, registered in another group: {', '.join(came)}" if came else "",
        f"registered in it, gone from it: {', '.join(left)}" if left else "") if part)
    raise ValueError(
        f"param group {gi}: its params differ from those it was registered with ({moves}); "
        "muond steps each param with the group it was registered in, so a param moved "
        "between groups or dropped from param_groups is not followed: build a new "
        "optimizer for the new grouping (add_param_group for new params)")


# The step ids a daemon's ImportState accepts, [-1, MAX_STEP_ID]
# (server/common/step_id.h, through muond._rules): checked here too so that a
# bad state dict is a ValueError naming the key before any RPC, not a
# protobuf range error half way through the import.
MAX_STEP_ID = _rules.MAX_STEP_ID


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


def check_gram_options(gi: int, group: dict) -> None:
    """A Muon group's Gram Newton-Schulz options (ns_algorithm, gram_restarts,
    gram_dtype, gram_min_aspect_ratio: fixed at registration) are what the
    daemon accepts, else ValueError naming group and key before any RPC. The
    rules' home is the daemon's ValidateGramOptions
    (core/muon/newton_schulz.cc); they are repeated here so that a typo
    fails at construction, not at registration."""
    label = group_label(gi, group)
    for key, names in (("ns_algorithm", _rules.NS_ALGORITHMS),
                       ("gram_dtype", _rules.GRAM_DTYPES)):
        allowed = list(names)
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
            # Integer-likes (numpy ints) count as ints; bools and floats do not.
            try:
                value = None if is_bool(r) else operator.index(r)
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
        ok = not isinstance(ratio, (str, bytes)) and not is_bool(ratio)
        try:
            value = float(ratio) if ok else None
        except (TypeError, ValueError):
            value = None
        if value is None or not (value == 0.0 or (math.isfinite(value) and value >= 1.0)):
            raise ValueError(f"{label}: 'gram_min_aspect_ratio' must be None, 0 (the default) "
                             f"or a finite number >= 1, got {ratio!r}")
    _check_fp16_coefficients(label, group)


# The largest finite fp16 value: a larger custom coefficient is inf once Gram
# NS casts it to its fp16 iteration dtype.
_FP16_MAX = 65504.0


def _check_fp16_coefficients(label: str, group: dict) -> None:
    """Custom coefficients are fp16-representable where Gram NS iterates in
    fp16 (ns_algorithm gram or auto, fp32_matmul_prec medium, gram_dtype
    fp16), as the daemon's ValidateGramOptions requires."""
    if (group.get("ns_algorithm") == "standard" or group.get("fp32_matmul_prec") != "medium"
            or group.get("gram_dtype") != "fp16"
            or group.get("coefficient_type", "custom") != "custom"):
        return
    flat = []
    for c in _sequence(group.get("custom_coefficients")):
        flat.extend(c if isinstance(c, (tuple, list)) else (c,))
    for i in range(0, len(flat) - len(flat) % 3, 3):
        try:
            t = tuple(float(x) for x in flat[i:i + 3])
        except (TypeError, ValueError):
            return  # not numbers: the daemon's parser names them
        if any(abs(x) > _FP16_MAX for x in t):
            raise ValueError(
                f"{label}: custom coefficients: tuple {i // 3} {t} is outside the fp16 range "
                "(|a|, |b|, |c| <= 65504) that Gram NS iterates in (ns_algorithm gram or auto, "
                "fp32_matmul_prec medium, gram_dtype fp16); use gram_dtype bf16, "
                "fp32_matmul_prec highest or smaller coefficients")


def loaded_options(gi: int, group: dict, saved: dict) -> dict:
    """The entries of a loaded param group that load_state_dict applies: the
    live ones (LIVE_KEYS). An entry fixed at registration must equal this
    group's (else ValueError naming group and key: the daemons could not
    follow it); entries this group does not have (a torch.optim.Muon dict's
    ns_coefficients, adjust_lr_fn, AdamW's foreach, ...) are not taken."""
    live = LIVE_KEYS[group["algorithm"]]
    apply = {}
    for key, value in saved.items():
        if key in PARAM_KEYS or key == _state.STEP_ID_KEY or key not in group:
            continue
        if key in live or key in KERNEL_KEYS:
            apply[key] = value
        elif (key in _variants.KEYS or key in _state_storage.KEYS
              or key in SCHEDULING_KEYS):
            # This optimizer's variant, state storage and NS batching win: a
            # checkpoint moves between variants, state dtypes and locations
            # and batch sizes.
            continue
        elif frozen(_torch_default(key, value)) != frozen(_torch_default(key, group[key])):
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


def check_fixed(param_groups, fixed: dict) -> None:
    """Raises before any RPC when a group entry the daemons fixed at
    registration (``fixed``: group index -> fixed_entries) changed (a change
    would otherwise be a silent no-op)."""
    for gi, group in enumerate(param_groups):
        registered = fixed.get(gi)
        if registered is None or registered.unchanged_in(group):
            continue
        for key, value in registered.items():
            now = frozen(group[key]) if key in group else "<removed>"
            if now != value:
                algorithm = group["algorithm"]
                given = group[key] if key in group else "<removed>"
                if key in _CYCLED_MOMENTUM_KEYS:
                    raise ValueError(_cycled_momentum_message(gi, group, key, value, given))
                raise ValueError(
                    f"param group {gi} ({group.get('name', f'group{gi}')!r}): {key!r} "
                    f"changed from {thawed(value)!r} to {given!r} after construction; "
                    "muond fixes "
                    f"it when it registers the group (the {algorithm} group's per-step "
                    f"entries are {', '.join(LIVE_KEYS[algorithm])}); build a new "
                    "optimizer to change it")


# The entries LR schedulers cycle with cycle_momentum=True (OneCycleLR,
# CyclicLR): "betas" when the optimizer's defaults have it (all groups
# AdamW), else "momentum", in every group. A Muon group's momentum and an
# AdamW group's betas are live; the other is not that group's at all.
_CYCLED_MOMENTUM_KEYS = ("momentum", "betas")


def _cycled_momentum_message(gi: int, group: dict, key: str, was, now) -> str:
    algorithm = group["algorithm"]
    live = LIVE_KEYS[algorithm]
    return (f"{group_label(gi, group)}: {key!r} changed from {thawed(was)!r} to {now!r}, but "
            f"an {algorithm} group does not use {key!r} (its per-step entries are "
            f"{', '.join(live)}). An LR scheduler that cycles momentum (OneCycleLR, CyclicLR: "
            "cycle_momentum=True, their default) sets 'momentum' on every group when Muon "
            "and AdamW groups are mixed: pass cycle_momentum=False to the scheduler")


def check_param(name: str, algorithm: str, p) -> None:
    """A param muond can register: fp32/bf16/fp16; in a Muon group at least
    2-D (a matrix, or a batch of matrices: muond.batched)."""
    if p.dtype not in _wire.DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _wire.DTYPES)
        raise ValueError(f"param {name}: dtype {p.dtype} not in ({names})")
    if algorithm == "muon" and p.ndim < 2:
        raise ValueError(
            f"param {name}: Muon params must be matrices (2-D) or batches of matrices "
            f"([..., m, n], e.g. [experts, m, n]): Newton-Schulz orthogonalises matrices, and "
            f"a param of shape {tuple(p.shape)} has none. Put it in an AdamW group: "
            '{"params": [p for p in model.parameters() if p.ndim < 2], "algorithm": "adamw"} '
            "beside {\"params\": [p for p in model.parameters() if p.ndim >= 2]}; or pass "
            "model.named_parameters() itself, not groups: every param that is not 2-D then "
            "goes to an AdamW group")


def wire_names(name: str, algorithm: str, p) -> list:
    """The names a param has on the wire: its own, or one per matrix of a
    batched Muon param (muond.batched.matrix_name)."""
    if algorithm != "muon" or not _batched.is_batched(p.shape):
        return [name]
    return [_batched.matrix_name(name, i) for i in _batched.batch_indices(p.shape[:-2])]


def param_names(gi: int, group: dict) -> list:
    """The wire names of a group's params: its param_names, else
    ``<group name>.param<j>``."""
    gname = group.get("name", f"group{gi}")
    return group.get("param_names") or [f"{gname}.param{j}" for j in range(len(group["params"]))]


def check_new_group(gi: int, group: dict, param_groups, known_names) -> None:
    """Everything about a group added after construction that can be
    checked without a daemon (ValueError naming group/param and rule)."""
    label = group_label(gi, group)
    algorithm = group.get("algorithm")
    if algorithm not in ("muon", "adamw"):
        raise ValueError(f"{label}: algorithm {algorithm!r} not in ('muon', 'adamw')")
    if algorithm == "adamw":
        check_adamw_options(gi, group)
    gname = group.get("name", f"group{gi}")
    taken = {g.get("name", f"group{i}") for i, g in enumerate(param_groups)}
    if gname in taken:
        raise ValueError(f"{label}: group name {gname!r} is already a group's")
    names = param_names(gi, group)
    if len(names) != len(group["params"]):
        raise ValueError(f"{label}: {len(names)} param_names for "
                         f"{len(group['params'])} params")
    known = set(known_names)
    for name, p in zip(names, group["params"]):
        check_param(name, algorithm, p)
        for wname in wire_names(name, algorithm, p):
            if wname in known:
                raise ValueError(f"{label}: param name {wname!r} appears twice")
            known.add(wname)
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"param {name}: muond handles cpu and cuda tensors, got "
                             f"{p.device}")
    check_options(gi, group)
    try:
        _wire.set_hyperparams(pb.ParamGroup(), group)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{label}: {e}") from e


class Collected:
    """Every param of the optimizer, checked (``collect_params``): ``todo``
    holds (group index, group name, group, param name, param); ``live`` the
    live entries each group is registered with; ``fixed`` each group's
    entries fixed at registration; ``names`` id(param) -> its wire name."""

    def __init__(self):
        self.todo: list = []
        self.live: dict = {}
        self.fixed: dict = {}
        self.names: dict = {}


def collect_params(param_groups, registered_live: dict, qkv=None) -> Collected:
    """Every param of ``param_groups``, checked (algorithm, names, dtype,
    Muon params matrices or batches of them, no name among another param's
    wire names); ``registered_live``: group index -> the live entries the
    daemons last accepted for it; ``qkv``: the muond.qkv_split.Choice of
    which params split QKV (it refuses a pick that is not 2-D, and picking
    nothing)."""
    out = Collected()
    seen = set()
    composite = {}  # a param with wire names <name>[...] -> what it is
    for gi, group in enumerate(param_groups):
        algorithm = group["algorithm"]
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"param group {gi}: algorithm {algorithm!r} not in "
                             "('muon', 'adamw')")
        # The live entries each group is registered with: as last registered
        # for a group the daemons accepted (param_groups may hold a value the
        # daemons refuse since, e.g. momentum=1.0: step() names that, and
        # add_param_group must not fail on it), else the group's own.
        registered = registered_live.get(gi)
        out.live[gi] = (dict(registered) if registered is not None else
                        {k: group[k] for k in LIVE_KEYS[algorithm] if k in group})
        gname = group.get("name", f"group{gi}")
        out.fixed[gi] = fixed_entries(group)
        for name, p in zip(param_names(gi, group), group["params"]):
            check_param(name, algorithm, p)
            for wname in wire_names(name, algorithm, p):
                if wname in seen:
                    raise ValueError(f"param name {wname!r} appears twice")
                seen.add(wname)
            out.names[id(p)] = name
            out.todo.append((gi, gname, group, name, p))
            # Every Muon param asks split_of (it refuses a pick that is not 2-D).
            if qkv is not None and qkv.split_of(group, p, name) is not None:
                composite[name] = "a split QKV weight"
            elif algorithm == "muon" and _batched.is_batched(p.shape):
                composite[name] = "a batch of matrices"
    _check_composite_names(out.names.values(), composite)
    if qkv is not None:
        qkv.check_picked(composite.values())
    return out


def _check_composite_names(names, composite: dict) -> None:
    """No param is named like a wire name of a batched or split QKV param
    (``<name>[...]``), else ValueError naming both."""
    for n in sorted(names):
        base = n.split("[", 1)[0]
        if n != base and base in composite and n not in composite:
            raise ValueError(f"param name {n!r} clashes with the wire names of param {base!r} "
                             f"({composite[base]}: its matrices are named {base}[...]); "
                             "rename one of them")
