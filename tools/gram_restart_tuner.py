#!/usr/bin/env python3
"""Default Gram Newton-Schulz restart iterations per coefficient set.

A port of the restart tuner of Dao-AILab's gram-newton-schulz 0.1.6
(gram_newton_schulz/restart_autotune.py, autotune_restarts.py): Gram NS
iterates on R = X X^T, whose rounding can leave small negative eigenvalues;
the polynomial step z = a + r (b + r c) then grows them instead of driving
them to 1. The tuner simulates the scalar iteration on the Gram eigenvalues
r = sigma^2 + perturbation (sigma on logspace(0, -10, 10000), perturbation
-4e-4: the peer's grid and default), with a restart re-forming
sigma <- q sigma and r from it, and scores a restart set by the largest
condition number max|q| / min|q| of the accumulated Q over all iterations
(the peer's stability_metric).

muond's rule (the peer picks positions for a fixed count, default 1):
  * num_steps == 1: no restart is possible -> [].
  * otherwise the fewest restarts k >= 1 whose best placement (lowest score,
    ties to the earliest positions) scores below 1e8 (the peer's blow-up
    bound); within that k the best placement. k starts at 1 even where no
    restart would score below 1e8 (torch's simple x 5 scores 3.8e6): the
    peer and the paper always restart once, and the score is a proxy for
    fp16 rounding, not a bound.
  * no placement passes: restart at every iteration 1..num_steps-1.
Outside the table (coefficient_type custom, num_steps > 10) muond does not
tune: DefaultGramRestarts (core/muon/coefficients.h) restarts every other
iteration from 2, more often than any tuned row.
Coefficients are read from core/muon/coefficients.cc (rounded to fp32 as
muond stores them) and scheduled as CoefficientSchedule does (cycle, or
repeat the last tuple for polar_express, cans and deepseekv4).

Usage (the committed table in core/muon/coefficients.cc is this output):
  python3 tools/gram_restart_tuner.py --max-steps 10
  python3 tools/gram_restart_tuner.py --check   # exit 1 if the table differs
"""
import argparse
import itertools
import pathlib
import re
import sys

import numpy as np

ROOT = pathlib.Path(__file__).absolute().parent.parent
COEFFS_CC = ROOT / "core/muon/coefficients.cc"
PERTURBATION = -4e-4
BLOWUP = 1e8
SETS = ("simple", "quintic", "polar_express", "aol", "cans", "deepseekv4")
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")


def _tuples(text):
    num = r"(-?[0-9.]+)f"
    return [tuple(float(np.float32(v)) for v in t)
            for t in re.findall(r"\{" + num + r",\s*" + num + r",\s*" + num +
                                r"\}", text)]


def builtin_sets(path=COEFFS_CC):
    """name -> list of (a, b, c), parsed from coefficients.cc."""
    src = path.read_text()
    out = {}
    simple = re.search(r"Simple\(\) \{(.*?)\n\}", src, re.S).group(1)
    out["simple"] = _tuples(simple)
    for name in ("quintic", "polar_express", "aol", "cans"):
        body = re.search(r"\*\s*" + name + r" =\s*new std::vector<NsCoefficients>"
                         r"\s*\{(.*?)\};", src, re.S).group(1)
        out[name] = _tuples(body)
    ds = re.search(r"\*\s*deepseekv4 = \[\] \{(.*?)\}\(\);", src, re.S).group(1)
    n_simple = int(re.search(r"NsCoefficients>\((\d+), Simple", ds).group(1))
    out["deepseekv4"] = out["simple"] * n_simple + _tuples(ds)
    return out


def schedule(name, tuples, num_steps):
    if name in REPEAT_LAST:
        return [tuples[min(i, len(tuples) - 1)] for i in range(num_steps)]
    return [tuples[i % len(tuples)] for i in range(num_steps)]


def score(coefs, restarts, sigma, perturbation=PERTURBATION):
    """The peer's simulate_perturbed_gram_newton_schulz + stability_metric."""
    x = sigma.copy()
    worst = 0.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for i, (a, b, c) in enumerate(coefs):
            if i == 0 or i in restarts:
                if i != 0:
                    x = x * q
                r = x * x + perturbation
                q = np.ones_like(x)
            z = a + r * (b + r * c)
            q = q * z
            r = r * z * z
            aq = np.abs(q)
            cond = aq.max() / aq.min()
            if not np.isfinite(cond):
                return float("inf")
            worst = max(worst, cond)
    return worst


def best_restarts(coefs, sigma):
    n = len(coefs)
    if n == 1:
        return [], score(coefs, set(), sigma)
    for k in range(1, n):
        best, best_score = None, float("inf")
        for combo in itertools.combinations(range(1, n), k):
            s = score(coefs, set(combo), sigma)
            if s < best_score:
                best, best_score = list(combo), s
        if best_score < BLOWUP:
            return best, best_score
    # Nothing passes (cans repeats a last tuple that is not a fixed point at
    # sigma = 1, so its long schedules diverge however Gram restarts):
    # restart at every iteration, which re-forms R from X each step like
    # standard NS.
    every = list(range(1, n))
    return every, score(coefs, set(every), sigma)


def table(max_steps, path=COEFFS_CC):
    sigma = np.logspace(0, -10, 10000)
    sets = builtin_sets(path)
    return {(name, steps): best_restarts(schedule(name, sets[name], steps),
                                         sigma)
            for name in SETS for steps in range(1, max_steps + 1)}


def committed_table(path=COEFFS_CC):
    """(name, num_steps) -> restarts, from the kGramRestartTable rows."""
    src = path.read_text()
    rows = re.findall(r'\{CoefficientType::k(\w+), (\d+), \{([0-9, ]*)\}\}',
                      src)
    camel = {"Simple": "simple", "Quintic": "quintic",
             "PolarExpress": "polar_express", "Aol": "aol", "Cans": "cans",
             "DeepseekV4": "deepseekv4"}
    return {(camel[t], int(s)): [int(v) for v in r.split(",") if v.strip()]
            for t, s, r in rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--check", action="store_true",
                   help="compare with the table in core/muon/coefficients.cc")
    p.add_argument("--coefficients", type=pathlib.Path, default=COEFFS_CC,
                   help="coefficients.cc to read (default: this checkout's)")
    args = p.parse_args()
    t = table(args.max_steps, args.coefficients)
    if args.check:
        got = committed_table(args.coefficients)
        want = {k: v[0] for k, v in t.items()}
        if got != want:
            for k in sorted(set(got) | set(want)):
                if got.get(k) != want.get(k):
                    print(f"{k}: committed {got.get(k)}, tuner {want.get(k)}")
            return 1
        print(f"ok: {len(want)} rows match")
        return 0
    camel = {"simple": "Simple", "quintic": "Quintic",
             "polar_express": "PolarExpress", "aol": "Aol", "cans": "Cans",
             "deepseekv4": "DeepseekV4"}
    for (name, steps), (restarts, s) in t.items():
        body = ", ".join(str(r) for r in restarts)
        print(f"    {{CoefficientType::k{camel[name]}, {steps}, {{{body}}}}},"
              f"  // cond(Q) {s:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
