#!/usr/bin/env python3
"""The per-step layout check of every registered param and grad
(``muond.torch.tensor_layout.SameLayout``): torch's C++ guards against the
Python passes the client used before (one pass in C per property: address,
shape, dtype, contiguity; ``is_set_to`` for a grad), side by side in one
process, at the param counts users register (the MoE layer's 388; 10,000
and 20,000: MoE models with per-expert params). CPU tensors, and CUDA ones
where a GPU is present. Prints a markdown table, median µs per check of
the whole list.

    .venv/bin/python bench/tensor_layout_checks.py
"""
from __future__ import annotations

import argparse
import operator
import os
import sys
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

from muond.torch import tensor_layout  # noqa: E402

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def python_param_passes(ps, ptrs, shapes, dtypes):
    """The params' check before SameLayout: four passes in C."""
    return (all(map(operator.eq, map(torch.Tensor.data_ptr, ps), ptrs))
            and all(map(operator.eq, map(_SHAPE, ps), shapes))
            and all(map(operator.is_, map(_DTYPE, ps), dtypes))
            and all(map(torch.Tensor.is_contiguous, ps)))


def python_grad_pass(grads, homes):
    """The grads' check before SameLayout: is_set_to, one pass in C."""
    return all(map(torch.Tensor.is_set_to, grads, homes))


def median_us(fn, number):
    runs = timeit.repeat(fn, number=number, repeat=15)
    runs.sort()
    return runs[len(runs) // 2] / number * 1e6


def measure(count: int, device: str) -> dict:
    flat = torch.zeros(count * 64, device=device)
    ps = [flat[i * 64:(i + 1) * 64].view(8, 8) for i in range(count)]
    homes = [p.detach() for p in ps]
    ptrs = [p.data_ptr() for p in ps]
    shapes = [p.shape for p in ps]
    dtypes = [p.dtype for p in ps]
    layout = tensor_layout.SameLayout(ps)
    assert layout.native and layout.holds(ps)
    assert python_param_passes(ps, ptrs, shapes, dtypes) and python_grad_pass(ps, homes)
    number = max(1, 20000 // count)
    before = (median_us(lambda: python_param_passes(ps, ptrs, shapes, dtypes), number)
              + median_us(lambda: python_grad_pass(ps, homes), number))
    after = 2 * median_us(lambda: layout.holds(ps), number)
    return dict(count=count, device=device, before=before, after=after)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="388,10000,20000")
    a = ap.parse_args()
    if not tensor_layout.native_usable():
        print(f"torch {torch.__version__}: its C++ guards are unusable here; "
              "the client falls back to the Python passes")
        return 1
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}; a param's check and its grad's, µs per step "
          "(median of 15)\n")
    print("| tensors | device | Python passes (before) | SameLayout, torch's C++ guards | ratio |")
    print("|---|---|---|---|---|")
    for device in devices:
        for count in map(int, a.counts.split(",")):
            r = measure(count, device)
            print(f"| {r['count']:,} | {r['device']} | {r['before']:,.0f} | {r['after']:,.0f} | "
                  f"{r['before'] / r['after']:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
