"""The FLOP model of bench/gpu_step_bench.py: what standard and Gram Newton-Schulz cost
per matrix, and muond's Gram defaults read from their C++ home (the restarts table and
the aspect-ratio threshold), so that the bench prints the fraction of the hardware's
ceiling each column reaches. Checked by tests/bench/gpu_step_bench_flops_test.py."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def standard_ns_flops(shape, steps: int = 5) -> float:
    """Standard NS as plain GEMMs (the count ns_bench uses), X s x L with s = the short side:
    per iteration A = X X^T (2 s^2 L), A^2 (2 s^3), B X (2 s^2 L)."""
    s, big = min(shape), max(shape)
    return steps * (4 * s * s * big + 2 * s ** 3)


def ideal_ns_flops(shape, algorithm: str, restarts=(), steps: int = 5,
                   min_aspect: float | None = 1.0) -> float:
    """FLOPs of the NS a column runs on one matrix, every symmetric product at half price
    (one triangle), the ceiling a symmetric kernel can reach. s = short side, L = long side.

    standard, per iteration: X X^T  s^2 L (symmetric); A^2  s^3 (symmetric);
      B X  2 s^2 L  ->  steps (3 s^2 L + s^3).
    gram (the iteration of docs/ARCHITECTURE.md and core/muon/gram_newton_schulz.h):
      R = X X^T once: s^2 L; the final X = Q X: 2 s^2 L;
      each restart r (0 < r < steps): X = Q X (2 s^2 L) and R = X X^T (s^2 L);
      each iteration i: Z = b R + c R^2: s^3;
        Q = Q Z + a Q unless i == 0 or i is a restart (Q = Z + a I, no product): s^3;
        unless i is the last or i + 1 a restart, RZ = R Z + a R and R = Z RZ + a RZ: 2 s^3
        (products of commuting symmetric matrices: symmetric).
      (= GramNewtonSchulz::IdealFlopsPerMatrix, core/muon/gram_newton_schulz.cc.)
      With 5 steps and one restart (at 2 or at 3): 6 s^2 L + 14 s^3, against 15 s^2 L +
      5 s^3 for standard: Gram wins when L/s is large, and square matrices stay on
      standard NS (gram applies only where L > s and L / s >= min_aspect).
    """
    s, big = min(shape), max(shape)
    if min_aspect is None:  # muond's size-aware default
        min_aspect = default_gram_min_aspect(s)
    if algorithm == "standard" or big == s or big / s < min_aspect:
        return steps * (3 * s * s * big + s ** 3)
    assert algorithm == "gram", algorithm
    rs = set(restarts)
    sl = s * s * big
    flops = sl + 2 * sl  # R = X X^T, final X = Q X
    for i in range(steps):
        if i != 0 and i in rs:
            flops += 3 * sl
        flops += s ** 3  # Z
        if i != 0 and i not in rs:
            flops += s ** 3  # Q Z + a Q
        if i < steps - 1 and (i + 1) not in rs:
            flops += 2 * s ** 3  # RZ, R
    return flops


def default_gram_restarts(gram_dtype: str, coefficients: str = "kSimple", steps: int = 5):
    """muond's default Gram restarts (DefaultGramRestarts) for this bench's NS (the simple
    set x 5 under medium, iterating in gram_dtype), read from its one home, the table in
    core/muon/coefficients.cc; None if the row is not found."""
    try:
        with open(os.path.join(ROOT, "core/muon/coefficients.cc")) as f:
            text = f.read()
    except OSError:
        return None
    dtype = {"fp16": "kFloat16", "bf16": "kBFloat16", "fp32": "kFloat32"}[gram_dtype]
    m = re.search(r"\{CoefficientType::" + coefficients + r",\s*" + str(steps) +
                  r",\s*DType::" + dtype + r",\s*\{([0-9,\s]*)\}\}", text)
    return None if m is None else [int(x) for x in m.group(1).split(",") if x.strip()]


def default_gram_min_aspect(short_side: int) -> float:
    """muond's measured default threshold for a short side, read from its one home (the
    C++ header, DefaultGramMinAspectRatio): the small-side value below the size bound."""
    try:
        with open(os.path.join(ROOT, "core/muon/gram_newton_schulz.h")) as f:
            text = f.read()
    except OSError:
        return 1.0
    def const(name):
        m = re.search(name + r"\s*=\s*([0-9.]+)", text)
        return float(m.group(1)) if m else None
    big = const(r"kDefaultGramMinAspectRatio")
    small = const(r"kDefaultGramMinAspectRatioSmall")
    below = const(r"kGramSmallShortSideBelow")
    if big is None:
        return 1.0
    return small if small is not None and below is not None and short_side < below else big
