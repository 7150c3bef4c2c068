#!/usr/bin/env python3
"""Accuracy of Newton-Schulz with fp8 (e4m3) GEMM operands, emulated on CPU.

Question: if some Newton-Schulz (NS) steps ran their GEMMs with e4m3 operands
and fp32 accumulation (Hopper's fp8 tensor cores), how far from the exact
polar factor would the result land, next to muond's 16-bit paths, and which
cheap online residual separates good results from bad ones?

Per input (bf16-rounded, as the medium path feeds NS):
  * the exact polar factor P = U V^T in fp64 (from the construction or an SVD
    of the unrounded input; rank-deficient inputs: the partial isometry on the
    nonzero singular values);
  * the exact polynomial: the same NS schedule in fp32 on the same bf16 input
    (rounding ~1e-6, far below the 16-bit paths'), so that an error can be
    split into the polynomial's own (NS does not converge sigma to 1) and the
    rounding's;
  * the variants, every GEMM emulated as the device runs it: operands in the
    iteration dtype (or quantised to e4m3), products accumulated in fp32,
    alpha/beta epilogue in fp32, the result rounded to the iteration dtype
    once; symmetric products mirrored from the lower triangle:
      std bf16        standard NS in bf16 (kMedium; torch.optim.Muon's too)
      gram fp16       Gram NS in fp16 with muond's default restarts
                      (DefaultGramRestarts), only on shapes the default sends
                      to Gram (aspect >= 2.5 below a short side of 1536)
      std fp8 K=k     standard NS, steps 0..k-1 with e4m3 operands, outputs
                      in bf16; the rest as std bf16
      gram fp8 K=k    Gram NS, every product of steps 0..k-1 (the initial
                      R = X X^T is step 0's, a restart's Q X and X X^T its
                      step's, the final Q X the last step's) with e4m3
                      operands, outputs in fp16; the rest as gram fp16
    k = all steps, all but the last, all but the last two. Scales:
      /t  per tensor: s = amax / 448 per operand (one float per matrix);
      /r  per row of the left operand and per column of the right one
          (the outer dimensions: the scales factor out of the K sum into the
          epilogue, as a row/column-scaled fp8 GEMM applies them; for
          X X^T that is one scale per row of X).
    The a*X (resp. a*Q, b*R ...) term enters as the GEMM's C in the 16-bit
    dtype, never quantised (cuBLASLt's fp8 GEMM adds a bf16/fp16 C in fp32).
Tall inputs run the transposed iteration (the same products transposed), so
only wide shapes are emulated.

Reported per run: relative Frobenius error to P (err) and to the exact
polynomial (rnd), sigma_max of the output, sigma_min over the input's
numerical rank, and candidate online residuals (section "checks" of the
output):
  smax    sigma_max(O) (online: a few power iterations, O(mn) each) against
          the set's bound max_[0,1] p + 0.05 (the numerics suite's);
  asym    ||S - S^T||_F / ||S + S^T||_F with S = X0 O^T (X0 the normalised
          input): the NS output is U f(Sigma) V^T, so X0 O^T = U Sigma f U^T
          is symmetric whatever f; an error in the singular vectors breaks
          the symmetry. Online: a k-column sketch W^T S W with W Gaussian
          m x k (asym_k, k = 8: 4 m n k flops, ~1% of one NS step at m = 512);
  mu2     sum sigma^2 / m = ||O||_F^2 / m (O(mn)), and for Gram NS the R it
          forms (trace R = sum sigma^2, ||R||_F^2 = sum sigma^4) for free.

Command (12 minutes on one core of a shared, busy 2-core machine):
  .venv/bin/python bench/ns/fp8_ns_accuracy.py > /tmp/fp8_ns.md
  .venv/bin/python bench/ns/fp8_ns_accuracy.py --quick   # 3 small shapes
"""
import argparse
import math
import statistics
import sys
import time

import torch

# core/muon/coefficients.cc (rounded to fp32 as muond stores them); 5 steps,
# muond's default num_steps. polar_express repeats its last tuple (not reached
# at 5 steps), simple and quintic cycle.
COEFFS = {
    "simple": [(3.4445, -4.7750, 2.0315)] * 5,
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985)],
}
COEFFS = {k: [tuple(float(torch.tensor(c, dtype=torch.float32)) for c in t)
              for t in v] for k, v in COEFFS.items()}
# DefaultGramRestarts(set, 5, kFloat16) (kGramRestartTable).
GRAM_RESTARTS_FP16 = {"simple": {3}, "quintic": {2}, "polar_express": {1, 3}}
SIGMA_SLACK = 0.05  # tests/core/muon/gram_spectra_suite.h kSigmaSlack
E4M3_MAX = 448.0    # core/backend/elementwise_math.h kE4M3Max
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

SHAPES = [(64, 256), (128, 512), (256, 640), (512, 1536), (768, 2048),
          (1024, 4096), (512, 512), (1024, 1024)]
QUICK_SHAPES = [(64, 256), (128, 512), (256, 256)]
KINDS = ("gaussian", "log_1e-3", "rank_m/2", "rank_m/8", "momentum")


def seeds_for(m, n, quick):
    if quick:
        return 2
    return 3 if m * n <= 128 * 512 else 2 if m * n <= 512 * 1536 else 1


# The largest shape, to keep the default run near 10 minutes on one core:
# three kinds, and no fp8 Gram variant with every product in e4m3 (it fails
# at every smaller shape).
BIG = 1024 * 4096
BIG_KINDS = ("log_1e-3", "rank_m/8", "momentum")


def kinds_for(m, n):
    return BIG_KINDS if m * n >= BIG else KINDS


def routes_to_gram(m, n):
    """muond's default (gram_newton_schulz.h): aspect >= 2.5 below a short
    side of 1536, else >= 1.5."""
    short, long_ = min(m, n), max(m, n)
    return long_ / short >= (2.5 if short < 1536 else 1.5)


# --- inputs ----------------------------------------------------------------

def _haar(gen, rows, cols):
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=gen,
                                       dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def make_input(kind, m, n, seed):
    """(fp64 input, fp64 polar factor, numerical rank)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        g = torch.randn(m, n, generator=gen, dtype=torch.float64)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        return g, u @ vh, m
    if kind == "momentum":
        # A momentum-like matrix: a few strong directions (k = m/32, singular
        # values 1 .. 0.1) over a Gaussian bulk whose top singular value is
        # ~5% of the leading one, rows scaled by log-normal factors (sigma
        # 0.5: rows of a gradient differ in norm, e.g. hot vs cold tokens or
        # channels) -- the case where one scale per tensor wastes e4m3's
        # range on the small rows.
        k = max(2, m // 32)
        u, v = _haar(gen, m, k), _haar(gen, n, k)
        s = torch.logspace(0, -1, k, dtype=torch.float64)
        bulk = torch.randn(m, n, generator=gen, dtype=torch.float64)
        bulk *= 0.05 / (math.sqrt(m) + math.sqrt(n))
        rows = torch.exp(0.5 * torch.randn(m, 1, generator=gen,
                                           dtype=torch.float64))
        g = rows * ((u * s) @ v.T + bulk)
        uu, _, vh = torch.linalg.svd(g, full_matrices=False)
        return g, uu @ vh, m
    u, v = _haar(gen, m, m), _haar(gen, n, m)
    if kind == "log_1e-3":
        s, rank = torch.logspace(0, -3, m, dtype=torch.float64), m
    else:
        rank = m // 2 if kind == "rank_m/2" else max(1, m // 8)
        s = torch.cat([torch.ones(rank, dtype=torch.float64),
                       torch.zeros(m - rank, dtype=torch.float64)])
    return (u * s) @ v.T, u[:, :rank] @ v[:, :rank].T, rank


# --- emulated GEMMs ----------------------------------------------------------

def rnd(x, dtype):
    return x if dtype == FP32 else x.to(dtype).to(FP32)


def quant_e4m3(x, per):
    """x (B, r, c) fp32 -> (e4m3 values as fp32, scale): per 'tensor' one
    amax/448 per matrix, per 'row' one per row (dim -1 reduced), per 'col'
    one per column. A zero scale (all-zero slice) quantises to 0."""
    dims = {"tensor": (-2, -1), "row": (-1,), "col": (-2,)}[per]
    amax = x.abs().amax(dim=dims, keepdim=True)
    scale = amax / E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(FP32), torch.where(scale > 0, scale, torch.zeros_like(scale))


class Gemms:
    """d = round(alpha op(a) op(b) + beta c) with the variant's operand
    rounding; counts FLOPs (2 m k n per product) by kind."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.flops = {"fp8": 0.0, "16": 0.0}
        self.sym_flops = {"fp8": 0.0, "16": 0.0}

    def __call__(self, a, b, alpha=1.0, beta=0.0, c=None, fp8=None,
                 sym=False):
        if fp8:
            per_a, per_b = ("tensor", "tensor") if fp8 == "t" else \
                ("row", "col")
            qa, sa = quant_e4m3(a, per_a)
            qb, sb = quant_e4m3(b, per_b)
            d = (qa @ qb) * (sa * sb)
        else:
            d = a @ b
        if alpha != 1.0:
            d = d * alpha
        if beta:
            d = d + beta * c
        if sym:  # lower triangle mirrored (SymmetricGemmStridedBatchedOut)
            d = torch.tril(d) + torch.tril(d, -1).transpose(-1, -2)
        f = 2.0 * a.shape[-2] * a.shape[-1] * b.shape[-1]
        key = "fp8" if fp8 else "16"
        self.flops[key] += f
        if sym:
            self.sym_flops[key] += f
        return rnd(d, self.dtype)


def normalise(g, dtype):
    """FrobeniusNormalize: fp64 norm, fp32 division, then the work dtype."""
    norm = g.double().square().sum(dim=(-2, -1), keepdim=True).sqrt()
    return rnd((g / norm.clamp_min(1e-15).float()), dtype)


def t(x):
    return x.transpose(-1, -2)


def standard_ns(g, coefs, dtype, fp8_steps=0, scale="t"):
    mm = Gemms(dtype)
    x = normalise(g, dtype)
    for s, (a, b, c) in enumerate(coefs):
        f8 = scale if s < fp8_steps else None
        am = mm(x, t(x), fp8=f8, sym=True)
        bm = mm(am, am, alpha=c, beta=b, c=am, fp8=f8, sym=True)
        x = mm(bm, x, beta=a, c=x, fp8=f8)
    return x, mm


def gram_ns(g, coefs, restarts, dtype, fp8_steps=0, scale="t",
            x_only=False):
    """muond's GramNewtonSchulz::Run (wide), the products of step i with
    e4m3 operands when i < fp8_steps (x_only: only the n-sized products,
    R = X X^T and Q X; the m x m ones stay 16-bit)."""
    mm = Gemms(dtype)
    x = normalise(g, dtype)
    n = len(coefs)
    f8x = lambda i: scale if i < fp8_steps else None  # noqa: E731
    f8 = (lambda i: None) if x_only else f8x  # noqa: E731
    r = mm(x, t(x), fp8=f8x(0), sym=True)
    eye = torch.eye(r.shape[-1], dtype=FP32)
    q = None
    for i, (a, b, c) in enumerate(coefs):
        if i != 0 and i in restarts:
            x = mm(q, x, fp8=f8x(i))
            r = mm(x, t(x), fp8=f8x(i), sym=True)
        z = mm(r, r, alpha=c, beta=b, c=r, fp8=f8(i), sym=True)
        if i == 0 or i in restarts:
            q = rnd(z + a * eye, dtype)
        else:
            q = mm(q, z, beta=a, c=q, fp8=f8(i), sym=True)
        if i + 1 < n and (i + 1) not in restarts:
            rz = mm(r, z, beta=a, c=r, fp8=f8(i), sym=True)
            r = mm(z, rz, beta=a, c=rz, fp8=f8(i), sym=True)
    return mm(q, x, fp8=f8x(n - 1)), mm


def poly_max(coefs):
    x = torch.linspace(0, 1, 100001, dtype=torch.float64)
    for a, b, c in coefs:
        r = x * x
        x = x * (a + r * (b + r * c))
    return float(x.max())


# --- metrics -----------------------------------------------------------------

def metrics(o, polar, exact, x0, rank, probes):
    """Per matrix of the batch: dict of the reported quantities."""
    finite = torch.isfinite(o).all(dim=-1).all(dim=-1)
    o64 = torch.where(finite[:, None, None], o, 0.0).double()
    err = (torch.linalg.matrix_norm(o64 - polar)
           / torch.linalg.matrix_norm(polar))
    rnd_err = (torch.linalg.matrix_norm(o64 - exact)
               / torch.linalg.matrix_norm(exact))
    o32 = o64.float()  # fp32 products: ~1e-6 relative, far below what is
    lam = torch.linalg.eigvalsh((o32 @ t(o32)).double())  # measured
    lam = lam.clamp_min(0).flip(-1)  # descending
    sig = lam.sqrt()
    m = o.shape[-2]
    s = (x0 @ t(o32)).double()
    asym = (torch.linalg.matrix_norm(s - t(s))
            / torch.linalg.matrix_norm(s + t(s)))
    sk = t(probes) @ s @ probes
    asym_k = (torch.linalg.matrix_norm(sk - t(sk))
              / torch.linalg.matrix_norm(sk + t(sk)))
    out = []
    for j in range(o.shape[0]):
        if not finite[j]:
            out.append(dict(err=math.inf, rnd=math.inf, smax=math.inf,
                            smin=0.0, orth=math.inf, mu2=math.inf,
                            asym=math.inf, asym_k=math.inf))
            continue
        r = rank[j]
        top = lam[j, :r]
        out.append(dict(
            err=float(err[j]), rnd=float(rnd_err[j]),
            smax=float(sig[j, 0]), smin=float(sig[j, r - 1]),
            orth=float(((top - 1) ** 2).sum().sqrt() / math.sqrt(m)),
            mu2=float(lam[j].sum() / m), asym=float(asym[j]),
            asym_k=float(asym_k[j])))
    return out


def variants(m, n, set_name):
    """(label, family, K, scale) in report order."""
    steps = len(COEFFS[set_name])
    ks = [steps, steps - 1, steps - 2]
    out = [("std bf16", "std", 0, None)]
    gram = routes_to_gram(m, n)
    if gram:
        out.append(("gram fp16", "gram", 0, None))
    fams = ["std", "gram", "gramx"] if gram else ["std"]
    if m * n >= BIG:
        fams = [f for f in fams if f != "gram"]
    for fam in fams:
        for sc in ("t", "r"):
            for k in ks:
                out.append((f"{fam} fp8 K={k}/{sc}", fam, k, sc))
    return out


def run_variant(fam, g, coefs, set_name, k, sc):
    if fam == "std":
        return standard_ns(g, coefs, BF16, k, sc or "t")
    return gram_ns(g, coefs, GRAM_RESTARTS_FP16[set_name], FP16, k, sc or "t",
                   x_only=fam == "gramx")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sets", default="simple,polar_express")
    p.add_argument("--shapes", default="",
                   help="MxN,... (wide, m <= n); default the study's set")
    p.add_argument("--json", default="", help="write every row here")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = ([tuple(int(v) for v in s.split("x"))
               for s in args.shapes.split(",")] if args.shapes else
              QUICK_SHAPES if args.quick else SHAPES)
    sets = args.sets.split(",")
    rows = []  # one dict per (set, shape, kind, seed, variant)
    t0 = time.time()
    for (m, n) in shapes:
        ns = seeds_for(m, n, args.quick)
        ins = [(kind, seed) + make_input(kind, m, n, 7919 * m + 31 * seed
                                         + ki)
               for ki, kind in enumerate(KINDS) if kind in kinds_for(m, n)
               for seed in range(ns)]
        g = rnd(torch.stack([v[2] for v in ins]).float(), BF16)
        polar = torch.stack([v[3] for v in ins])
        rank = [v[4] for v in ins]
        x0 = normalise(g, FP32)
        probes = torch.randn(len(ins), m, 8, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(m))
        for set_name in sets:
            coefs = COEFFS[set_name]
            exact, _ = standard_ns(g, coefs, FP32)
            exact = exact.double()
            for label, fam, k, sc in variants(m, n, set_name):
                o, mm = run_variant(fam, g, coefs, set_name, k, sc)
                tot = mm.flops["fp8"] + mm.flops["16"]
                sym = mm.sym_flops["fp8"] + mm.sym_flops["16"]
                for (kind, seed, *_), met in zip(
                        ins, metrics(o, polar, exact, x0, rank, probes)):
                    rows.append(dict(
                        set=set_name, shape=f"{m}x{n}", kind=kind, seed=seed,
                        variant=label, family=fam, k=k, scale=sc,
                        fp8_frac=mm.flops["fp8"] / tot,
                        fp8_frac_ideal=(mm.flops["fp8"]
                                        - mm.sym_flops["fp8"] / 2)
                        / (tot - sym / 2), **met))
            print(f"# {m}x{n} {set_name} done at {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(rows, f)
    report(rows, sets, shapes, time.time() - t0)


# --- report ------------------------------------------------------------------

def _fmt(v):
    return f"{v:.3f}" if v >= 0.0995 else f"{v:.3g}" if v >= 1e-3 else \
        f"{v:.1e}"


def report(rows, sets, shapes, seconds):
    by = {}
    for r in rows:
        by.setdefault((r["set"], r["shape"], r["kind"], r["seed"]),
                      {})[r["variant"]] = r
    # baselines per input: std bf16 for std variants, gram fp16 for gram
    for inp in by.values():
        for r in inp.values():
            base = inp["gram fp16"] if r["family"].startswith("gram") else \
                inp["std bf16"]
            r["ratio"] = r["err"] / base["err"]
            r["ratio_std"] = r["err"] / inp["std bf16"]["err"]
            r["rnd_ratio"] = r["rnd"] / base["rnd"]
    shape_names = [f"{m}x{n}" for m, n in shapes]
    print(f"Total {seconds:.0f} s. Cells: median / worst over kinds x seeds "
          "of the relative Frobenius error to the exact polar factor.\n")
    for s in sets:
        srows = [r for r in rows if r["set"] == s]
        labels = list(dict.fromkeys(r["variant"] for r in srows))
        bound = poly_max(COEFFS[s]) + SIGMA_SLACK
        print(f"## {s} x 5 (sigma_max bound {bound:.3f})\n")
        print("err to U V^T, median / worst:\n")
        print("| variant | fp8 FLOPs | " + " | ".join(shape_names) + " |")
        print("|---" * (len(shape_names) + 2) + "|")
        for lab in labels:
            cells, fr = [], ""
            for sh in shape_names:
                v = [r["err"] for r in srows
                     if r["variant"] == lab and r["shape"] == sh]
                if not v:
                    cells.append("")
                    continue
                cells.append(f"{_fmt(statistics.median(v))} / {_fmt(max(v))}")
                if not fr:
                    fr = max(r["fp8_frac"] for r in srows
                             if r["variant"] == lab and r["shape"] == sh)
            print(f"| {lab} | {fr:.0%} | " + " | ".join(cells) + " |"
                  if isinstance(fr, float) else
                  f"| {lab} | | " + " | ".join(cells) + " |")
        print()
        print("rounding error (to the exact polynomial), median / worst:\n")
        print("| variant | " + " | ".join(shape_names) + " |")
        print("|---" * (len(shape_names) + 1) + "|")
        for lab in labels:
            cells = []
            for sh in shape_names:
                v = [r["rnd"] for r in srows
                     if r["variant"] == lab and r["shape"] == sh]
                cells.append(f"{_fmt(statistics.median(v))} / {_fmt(max(v))}"
                             if v else "")
            print(f"| {lab} | " + " | ".join(cells) + " |")
        print()
        print("per variant over all shapes: err / its 16-bit path's err "
              "(median, worst), err / std bf16's (worst), sigma range, "
              "checks:\n")
        print("| variant | fp8 FLOPs (ideal) | err/16-bit med | worst | "
              "err/std bf16 worst | sigma_min | sigma_max | orth top-r max "
              "| asym max | asym_k max |")
        print("|---" * 10 + "|")
        for lab in labels:
            v = [r for r in srows if r["variant"] == lab]
            fr = statistics.median(r["fp8_frac"] for r in v)
            fi = statistics.median(r["fp8_frac_ideal"] for r in v)
            print(f"| {lab} | {fr:.0%} ({fi:.0%}) | "
                  f"{statistics.median(r['ratio'] for r in v):.2f} | "
                  f"{max(r['ratio'] for r in v):.2f} | "
                  f"{max(r['ratio_std'] for r in v):.2f} | "
                  f"{min(r['smin'] for r in v):.3f} | "
                  f"{max(r['smax'] for r in v):.3f} | "
                  f"{max(r['orth'] for r in v):.3f} | "
                  f"{_fmt(max(r['asym'] for r in v))} | "
                  f"{_fmt(max(r['asym_k'] for r in v))} |")
        print()
    check_report(rows, sets)


def check_report(rows, sets):
    """The online check, evaluated on every fp8 run. bad: err > 1.5x its
    16-bit path's err on the same input. The check falls back when the
    output is not finite, sigma_max(O) > the set's bound, or asym_k > tau.
    Two taus, both from this data: tau_16 = 4x the largest asym_k of the
    16-bit paths (fp8 as faithful as 16 bits), and tau_bad = just below the
    smallest asym_k among the bad runs that pass the sigma_max bound (the
    largest tau that misses none here)."""
    fp8 = [r for r in rows if r["k"] > 0]
    bound = {s: poly_max(COEFFS[s]) + SIGMA_SLACK for s in sets}
    for r in fp8:
        r["bad"] = not r["ratio"] <= 1.5
        r["smax_fail"] = not r["smax"] <= bound[r["set"]]
    tau_16 = 4.0 * max(r["asym_k"] for r in rows if r["k"] == 0)
    slipped = [r["asym_k"] for r in fp8 if r["bad"] and not r["smax_fail"]]
    tau_bad = 0.99 * min(slipped) if slipped else math.inf
    print("## Online check\n")
    print(f"Fallback when O is not finite, sigma_max(O) > max p + "
          f"{SIGMA_SLACK}, or asym_k > tau. tau_16 = 4 x the 16-bit paths' "
          f"largest asym_k = {_fmt(tau_16)}; tau_bad = just below the "
          f"smallest asym_k of a bad run within the sigma bound = "
          f"{_fmt(tau_bad)} ({len(slipped)} bad runs pass the sigma bound)."
          "\n")
    print("| set | variant | runs | bad | sigma-bound fallbacks (bad "
          "among them) | tau_16: fallbacks, missed bad | tau_bad: fallbacks, "
          "missed bad |")
    print("|---" * 7 + "|")
    for s in sets:
        labels = list(dict.fromkeys(r["variant"] for r in fp8
                                    if r["set"] == s))
        for lab in labels:
            v = [r for r in fp8 if r["set"] == s and r["variant"] == lab]
            cells = []
            for tau in (tau_16, tau_bad):
                fb = [r["smax_fail"] or not r["asym_k"] <= tau for r in v]
                cells.append(f"{sum(fb)} ({sum(fb) / len(v):.0%}), "
                             f"{sum(r['bad'] and not f for r, f in zip(v, fb))}")
            sf = [r for r in v if r["smax_fail"]]
            print(f"| {s} | {lab} | {len(v)} | {sum(r['bad'] for r in v)} | "
                  f"{len(sf)} ({sum(r['bad'] for r in sf)}) | "
                  + " | ".join(cells) + " |")
    print()
    print("Bad runs within the sigma bound (what asym_k has to catch):\n")
    print("| set | shape | kind | variant | err / 16-bit | sigma_max | asym_k |")
    print("|---" * 7 + "|")
    for r in sorted((r for r in fp8 if r["bad"] and not r["smax_fail"]),
                    key=lambda r: r["asym_k"])[:25]:
        print(f"| {r['set']} | {r['shape']} | {r['kind']} | {r['variant']} | "
              f"{r['ratio']:.2f} | {r['smax']:.3f} | {_fmt(r['asym_k'])} |")
    print()


if __name__ == "__main__":
    main()
