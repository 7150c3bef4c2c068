"""Split QKV and per-head Newton-Schulz: a fused attention weight as several
matrices, each orthogonalised on its own.

The seed API's rule (Megatron-Core's TensorParallelMuon, Emerging-Optimizers):
with ``split_qkv=True``, a param for which ``is_qkv_fn(param)`` is true, of
full shape (P, Q), is viewed as ``(P / sum(qkv_split_shapes),
sum(qkv_split_shapes), Q)`` (Megatron's fused layout: per query group, its
query rows, then its key rows, then its value rows), split along dim 1 into
``qkv_split_shapes`` and each part reshaped to ``(-1, Q)``: the Q, K and V
matrices, each with every query group's rows. Each is orthogonalised and
scaled as a matrix of its own shape, and the results go back to their rows.

``qkv_head_dim`` (muond's; per-head Muon) orthogonalises every head of every
part of every query group on its own instead: a block of ``qkv_head_dim``
rows.

A matrix is a selection of the param's full rows (``selections``). On the
wire each is a param named ``<param>[q]`` (``[k]``, ``[v]``, or ``[q.<group>.
<head>]`` per head; ``[s<j>]`` for a split that is not three parts) whose
memory is a staging copy of the param's local rows, reordered so that each
matrix's rows are contiguous: ``muond.torch.memory`` copies the rows in and
out at every step (``perm``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowSplit:
    """How a param splits: the per-group row counts of its parts
    (``qkv_split_shapes``) and, for per-head NS, the rows of a head."""
    shapes: tuple
    head_dim: int | None = None


def _part_names(count: int) -> list[str]:
    return ["q", "k", "v"] if count == 3 else [f"s{j}" for j in range(count)]


def selections(name: str, rows: int, split: RowSplit) -> list[tuple[str, list[int]]]:
    """(wire name, the param's full rows it holds, ascending) of every matrix
    of param ``name`` with ``rows`` full rows, or ValueError naming the param
    and the rule."""
    total = sum(split.shapes)
    if rows % total:
        raise ValueError(f"param {name}: split_qkv views its {rows} rows as (query groups, "
                         f"sum(qkv_split_shapes)={total}, -1), but {rows} % {total} != 0")
    groups = rows // total
    parts, start = [], 0
    for part, size in zip(_part_names(len(split.shapes)), split.shapes):
        parts.append((part, start, size))
        start += size
    if split.head_dim is None:
        return [(f"{name}[{part}]", [g * total + offset + i for g in range(groups)
                                     for i in range(size)])
                for part, offset, size in parts]
    d = split.head_dim
    bad = [size for _, _, size in parts if size % d]
    if bad:
        raise ValueError(f"param {name}: qkv_head_dim={d} does not divide the parts "
                         f"{list(split.shapes)} of qkv_split_shapes")
    return [(f"{name}[{part}.{g}.{h}]", list(range(g * total + offset + h * d,
                                                   g * total + offset + (h + 1) * d)))
            for g in range(groups) for part, offset, size in parts for h in range(size // d)]


def check_options(split_qkv, is_qkv_fn, shapes, head_dim) -> RowSplit | None:
    """The split of a Muon group's QKV params from its options (the seed
    API's split_qkv, is_qkv_fn, qkv_split_shapes; muond's qkv_head_dim), None
    when split_qkv is off; ValueError naming the option and the rule."""
    if not split_qkv:
        if head_dim is not None:
            raise ValueError("qkv_head_dim needs split_qkv=True (and is_qkv_fn, "
                             "qkv_split_shapes)")
        return None
    if is_qkv_fn is None or shapes is None:
        raise ValueError("split_qkv=True requires both is_qkv_fn and qkv_split_shapes (as "
                         "Megatron's TensorParallelMuon)")
    if not callable(is_qkv_fn):
        raise ValueError(f"is_qkv_fn must be a callable (param -> bool), got "
                         f"{type(is_qkv_fn).__name__}")
    ok = (not isinstance(shapes, (str, bytes)) and hasattr(shapes, "__len__")
          and len(shapes) > 0 and all(isinstance(s, int) and not isinstance(s, bool)
                                      and s > 0 for s in shapes))
    if not ok:
        raise ValueError(f"qkv_split_shapes must be a list of positive ints (rows of q, k, "
                         f"v per query group), got {shapes!r}")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)
                                 or head_dim <= 0):
        raise ValueError(f"qkv_head_dim must be None or a positive int, got {head_dim!r}")
    return RowSplit(tuple(int(s) for s in shapes), head_dim)


@dataclass(frozen=True)
class Choice:
    """Which Muon params split and how: ``split_of(group, param)`` is the
    RowSplit of a 2-D param ``is_qkv_fn`` picks, else None."""
    split: RowSplit | None = None
    is_qkv_fn: object = None

    @classmethod
    def of(cls, options: dict) -> "Choice":
        """From Muon's resolved options (ValueError naming the rule)."""
        split = check_options(options["split_qkv"], options["is_qkv_fn"],
                              options["qkv_split_shapes"], options["qkv_head_dim"])
        return cls(split, options["is_qkv_fn"] if split is not None else None)

    def split_of(self, group: dict, p) -> RowSplit | None:
        if self.split is None or group.get("algorithm", "muon") != "muon" or p.ndim != 2:
            return None
        return self.split if self.is_qkv_fn(p) else None
