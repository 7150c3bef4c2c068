#!/usr/bin/env python3
"""What the field's Muon forms cost on one GPU, side by side in one process: each row a
muond.torch.Muon through its own CUDA daemon on the same params and grads (fp32 params,
bf16 NS, muond's defaults otherwise), median of --reps steps; each ratio against the
set's baseline row, measured in the same run.

  moe      the Qwen3-30B-A3B MoE layer (attention + 128 experts of gate, up, down):
           experts as 384 separate 2-D params (baseline) against the same experts as
           three [128, m, n] params (muond.batched), ns_batch_size 256;
  qkv      Llama-3-8B's first 4 layers, q, k, v as separate params (baseline) against one
           fused [6144, 4096] QKV weight per layer: unsplit, split_qkv (Q, K, V apart) and
           per head (qkv_head_dim 128), and split_qkv with QK-clip on every layer;
  variant  the Llama-3-8B 4-layer set and the MoE layer (experts batched): variant "muon"
           (baseline) against "normuon" and "adamuon".

    MUOND_BIN=<bundle>/bin python3 bench/gpu_variants_bench.py --out variants.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

from gpu_step_bench import SETTINGS, free, timed  # noqa: E402

LLAMA_LAYERS = 4
HEADS, GROUPS, HEAD_DIM, HIDDEN = 32, 8, 128, 4096  # Llama-3-8B attention
QKV_SHAPES = [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM]


def manifest(name: str) -> list:
    with open(os.path.join(HERE, "manifests", f"{name}.json")) as f:
        return json.load(f)["params"]


def layer_params(name: str, layers: int) -> list:
    return [(p["name"], tuple(p["shape"])) for p in manifest(name)
            if len(p["shape"]) == 2 and p["name"].startswith("layers.")
            and int(p["name"].split(".")[1]) < layers]


def moe_sets():
    """(separate experts, batched experts): (name, shape) lists of layer 0."""
    params = layer_params("qwen3_30b_a3b", 1)
    dense = [(n, s) for n, s in params if ".experts." not in n]
    experts = [(n, s) for n, s in params if ".experts." in n]
    batched = {}
    for n, s in experts:
        kind = n.rsplit(".", 1)[1]
        batched.setdefault(kind, []).append(s)
    stacked = [(f"layers.0.mlp.experts.{k}", (len(v), *v[0])) for k, v in batched.items()]
    return dense + experts, dense + stacked


def llama_sets():
    """(q, k, v separate, fused QKV) of Llama-3-8B's first layers."""
    params = layer_params("llama3_8b", LLAMA_LAYERS)
    separate = params
    fused = []
    for n, s in params:
        if n.endswith(("k_proj", "v_proj")):
            continue
        if n.endswith("q_proj"):
            fused.append((n.replace("q_proj", "qkv_proj"), (GROUPS * sum(QKV_SHAPES), HIDDEN)))
        else:
            fused.append((n, s))
    return separate, fused


def run(named_shapes, reps, warmup, label, log_dir, qk_clip=False, **kw):
    """Median ms of a muond step on ``named_shapes`` through a fresh daemon."""
    import torch
    from daemon_harness import Daemon
    from muond.torch import Muon
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = []
    for n, s in named_shapes:
        p = torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", generator=g))
        p.is_qkv = n.endswith("qkv_proj")
        ps.append(p)
    names = [n for n, _ in named_shapes]
    extra = {}
    if qk_clip:
        from muond.torch import QKClip, QKClipAttention
        extra["qk_clip"] = QKClip([QKClipAttention(n, num_heads=HEADS, num_kv_heads=GROUPS,
                                                   head_dim=HEAD_DIM, qkv=p)
                                   for n, p in zip(names, ps) if p.is_qkv], threshold=100.0)
    job = "variants-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:48]
    with Daemon(job, log_dir=log_dir) as d:
        opt = Muon([{"params": ps, "param_names": names}], daemons=[d.address], job_id=job,
                   fp32_matmul_prec="medium", **SETTINGS, **kw, **extra)
        try:
            opt.zero_grad(set_to_none=False)
            for p in ps:
                p.grad.copy_(1e-3 * torch.randn(p.shape, device="cuda", generator=g))
            # Half the heads above the threshold: every step rescales some rows.
            logits = {n: torch.linspace(50.0, 150.0, HEADS) for n, p in zip(names, ps)
                      if p.is_qkv}

            def step():
                opt.step(**({"qk_max_logits": logits} if qk_clip else {}))

            return timed(step, reps, warmup)
        finally:
            opt.close()
            del ps
            free()


def has_variants() -> bool:
    from muond.torch import options
    return "variant" in options.FLAT_KEYWORDS


def plan(has_variant_options: bool) -> list:
    """(set, form, named shapes, baseline form, Muon keywords) of every row."""
    separate, batched = moe_sets()
    rows = [("moe", "experts as 384 2-D params", separate, None, dict(ns_batch_size=256)),
            ("moe", "experts as 3 [128, m, n] params", batched, "experts as 384 2-D params",
             dict(ns_batch_size=256))]
    separate, fused = llama_sets()
    base = "q, k, v separate params"
    split = dict(split_qkv=True, is_qkv_fn=lambda p: p.is_qkv, qkv_split_shapes=QKV_SHAPES,
                 ns_batch_size=4)
    rows += [("qkv", base, separate, None, dict(ns_batch_size=4)),
             ("qkv", "fused QKV, unsplit", fused, base, dict(ns_batch_size=4)),
             ("qkv", "fused QKV, split_qkv", fused, base, split),
             ("qkv", "fused QKV, per head (128 rows)", fused, base,
              dict(split, qkv_head_dim=HEAD_DIM)),
             ("qkv", "fused QKV, split_qkv + QK-clip", fused, base, dict(split, qk_clip=True))]
    if has_variant_options:
        rows.append(("variant", "muon", separate, None, dict(ns_batch_size=4)))
        rows += [("variant", v, separate, "muon", dict(ns_batch_size=4, variant=v))
                 for v in ("normuon", "adamuon")]
        experts, batched = moe_sets()
        rows.append(("moe variant", "muon", batched, None, dict(ns_batch_size=256)))
        rows += [("moe variant", v, batched, "muon", dict(ns_batch_size=256, variant=v))
                 for v in ("normuon", "adamuon")]
    return rows


def timed_qk_clip():
    """Wraps QK-clip's prepare and apply with timers: (times dict, undo)."""
    import torch
    from muond.torch import qk_clip
    times = {"prepare": [], "apply": []}
    originals = {k: getattr(qk_clip, k) for k in times}

    def wrap(key):
        def timed_call(*args, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = originals[key](*args, **kw)
            torch.cuda.synchronize()
            times[key].append((time.perf_counter() - t0) * 1e3)
            return out
        return timed_call
    for k in times:
        setattr(qk_clip, k, wrap(k))
    return times, lambda: [setattr(qk_clip, k, f) for k, f in originals.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--sets", default=None,
                    help="comma-separated sets to run (moe, qkv, variant, moe variant); "
                         "default all")
    a = ap.parse_args()
    log_dir = a.log_dir or os.environ.get("OUT", "/tmp")
    rows = plan(has_variants())
    if a.sets:
        keep = {s.strip() for s in a.sets.split(",")}
        rows = [row for row in rows if row[0] in keep]
    ms = {}
    for r in range(a.rounds):
        for set_name, form, shapes, _, kw in rows:
            kw = dict(kw)
            undo = None
            if kw.get("qk_clip"):
                clip_times, undo = timed_qk_clip()
            try:
                t = run(shapes, a.reps, a.warmup, f"{set_name}-{form}", log_dir, **kw)
            finally:
                if undo is not None:
                    undo()
            ms.setdefault((set_name, form), []).append(t)
            extra = ""
            if kw.get("qk_clip"):
                extra = "  (QK-clip prepare %.2f ms, apply %.2f ms, medians)" % tuple(
                    sorted(v)[len(v) // 2] for v in clip_times.values())
            print(f"round {r + 1} {set_name:8s} {form:34s} {t:8.2f} ms{extra}", flush=True)
    # The lower median of the rounds (the faster of two): a round's first rows
    # can catch the GPU still clocking up.
    med = {k: sorted(v)[(len(v) - 1) // 2] for k, v in ms.items()}
    lines = [f"| set | form | ms (lower median of {a.rounds} rounds) | vs the set's baseline |",
             "|---|---|---|---|"]
    for set_name, form, _, base, _ in rows:
        t = med[(set_name, form)]
        ratio = f"{t / med[(set_name, base)]:.3f}" if base else "1 (baseline)"
        lines.append(f"| {set_name} | {form} | {t:.2f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
