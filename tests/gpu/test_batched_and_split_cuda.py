#!/usr/bin/env python3
"""Batched expert params and split QKV on a GPU (tag gpu): CUDA IPC regions,
the CUDA engine, muond's defaults (bf16 NS, "medium").

1. An [E, m, n] expert param steps BITWISE as its E matrices given as separate
   2-D params (one daemon each, the same engine), its momentum_buffer has the
   param's shape and equals theirs stacked.
2. A fused QKV weight with split_qkv (and per head) steps BITWISE as its Q, K,
   V (heads) given as separate params, cut by the seed's rule here; the
   staging rows travel through device index_select / index_copy_.
3. QK-clip on the split weight: the heads whose max logit exceeds the
   threshold are scaled by the paper's factor after the step (against the
   unclipped run's rows).
Exit code 0 = pass. Needs a GPU; prints SKIP without one (--host runs the same
on a host-mode daemon and CPU tensors, to check the test).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

DEVICE = "cpu" if "--host" in sys.argv else "cuda"
EXPERTS = (8, 96, 64)
HEADS, GROUPS, HEAD_DIM, HIDDEN = 8, 2, 16, 64
SHAPES = [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM]
ROWS = GROUPS * sum(SHAPES)
STEPS = 3


def rand(shape, seed, scale=0.02):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return scale * torch.randn(shape, device=DEVICE, generator=g)


def parts(t, head_dim=None):
    grouped = t.reshape(GROUPS, sum(SHAPES), HIDDEN)
    qkv = torch.split(grouped, SHAPES, dim=1)
    if head_dim is None:
        return [x.reshape(-1, HIDDEN) for x in qkv]
    return [h for g in range(GROUPS) for x in qkv for h in torch.split(x[g], head_dim)]


def whole(ps, head_dim=None):
    if head_dim is None:
        return torch.cat([x.reshape(GROUPS, -1, HIDDEN) for x in ps], dim=1).reshape(ROWS, HIDDEN)
    return torch.cat(ps).reshape(ROWS, HIDDEN)


def run(d, job, params, grads_of, steps=STEPS, **kw):
    from muond.torch import Muon
    names = [f"p{i}" for i in range(len(params))]
    opt = Muon([{"params": params, "param_names": names}], lr=0.02, daemons=[d.address],
               job_id=d.job_id, **kw)
    try:
        for s in range(steps):
            for p, g in zip(params, grads_of(s)):
                p.grad = g
            opt.step()
        return [opt.state[p]["momentum_buffer"].clone() for p in params]
    finally:
        opt.close()


def check_experts(d, failures):
    batched = torch.nn.Parameter(rand(EXPERTS, 0))
    separate = [torch.nn.Parameter(m.clone()) for m in batched.detach()]
    grads = [rand(EXPERTS, 100 + s, 1e-3) for s in range(STEPS)]
    (m3,) = run(d, "experts", [batched], lambda s: [grads[s]])
    ms = run(d, "experts", separate, lambda s: list(grads[s]))
    got, want = batched.detach(), torch.stack([p.detach() for p in separate])
    print(f"experts: max |batched - separate| = {float((got - want).abs().max()):.3e}")
    if not torch.equal(got, want):
        failures.append("experts: the [E, m, n] param differs from its separate matrices")
    if tuple(m3.shape) != EXPERTS or not torch.equal(m3, torch.stack(ms)):
        failures.append("experts: momentum_buffer is not the matrices' stacked")


def check_split(d, failures, head_dim):
    label = f"split_qkv{'' if head_dim is None else f' per head {head_dim}'}"
    fused = torch.nn.Parameter(rand((ROWS, HIDDEN), 1))
    fused.is_qkv = True
    separate = [torch.nn.Parameter(x.clone()) for x in parts(fused.detach(), head_dim)]
    grads = [rand((ROWS, HIDDEN), 200 + s, 1e-3) for s in range(STEPS)]
    kw = dict(split_qkv=True, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
              qkv_split_shapes=SHAPES, qkv_head_dim=head_dim)
    (mf,) = run(d, "split", [fused], lambda s: [grads[s]], **kw)
    ms = run(d, "split", separate, lambda s: parts(grads[s], head_dim))
    want = whole([p.detach() for p in separate], head_dim)
    print(f"{label}: max |fused - parts| = {float((fused.detach() - want).abs().max()):.3e}")
    if not torch.equal(fused.detach(), want):
        failures.append(f"{label}: the fused weight differs from its parts")
    if not torch.equal(mf, whole(ms, head_dim)):
        failures.append(f"{label}: momentum_buffer is not the parts' in their rows")


def check_qk_clip(d, failures):
    from muond.torch import Muon, QKClip, QKClipAttention
    start = rand((ROWS, HIDDEN), 3)
    grads = [rand((ROWS, HIDDEN), 300 + s, 1e-3) for s in range(1)]
    out = {}
    for clip in (False, True):
        w = torch.nn.Parameter(start.clone())
        extra = {}
        if clip:
            extra["qk_clip"] = QKClip([QKClipAttention("attn", HEADS, num_kv_heads=GROUPS,
                                                       head_dim=HEAD_DIM, qkv=w)],
                                      threshold=100.0)
        opt = Muon([{"params": [w], "param_names": ["qkv"]}], lr=0.02, daemons=[d.address],
                   job_id=d.job_id, **extra)
        try:
            w.grad = grads[0]
            maxima = torch.full((HEADS,), 50.0)
            maxima[0] = 400.0  # head 0 of group 0: gamma = 0.25
            opt.step(**({"qk_max_logits": {"attn": maxima}} if clip else {}))
        finally:
            opt.close()
        out[clip] = w.detach().clone()
    q0 = slice(0, HEAD_DIM)  # group 0's first query head
    k0 = slice(SHAPES[0], SHAPES[0] + HEAD_DIM)  # group 0's key head
    rest = slice(SHAPES[0] + HEAD_DIM, ROWS)
    ok = (torch.allclose(out[True][q0], out[False][q0] * 0.5, rtol=1e-6, atol=0)
          and torch.allclose(out[True][k0], out[False][k0] * 0.5, rtol=1e-6, atol=0)
          and torch.equal(out[True][rest], out[False][rest]))
    print(f"qk-clip: head 0 q and its key scaled by 0.5, the rest unchanged: {ok}")
    if not ok:
        failures.append("qk-clip: the clipped rows are not the paper's factor of the step's")


def main() -> int:
    if DEVICE == "cuda" and not cuda_or_skip():
        return 0
    failures = []
    with Daemon("batched", host=DEVICE == "cpu") as d:
        check_experts(d, failures)
        for head_dim in (None, HEAD_DIM):
            check_split(d, failures, head_dim)
    with Daemon("clip", host=DEVICE == "cpu") as d:
        check_qk_clip(d, failures)
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
