#!/usr/bin/env python3
"""muond through the daemon (CUDA IPC, cuBLAS bf16 NS) vs torch.optim.Muon,
same process, identical copies, same settings (tag gpu).

torch.optim.Muon's math: simple coefficients (3.4445, -4.775, 2.0315) x 5,
eps 1e-7, `original` scale sqrt(max(1, rows/cols)), Nesterov, decoupled weight
decay, NS in bf16. muond: coefficient_type simple, scale_mode original,
fp32_matmul_prec medium (bf16 operands, fp32 accumulation).

1. Ten steps on Llama-like shapes (Llama-3-8B scaled down 4x: hidden 1024,
   FFN 3584, kv 256; --layers of them) with the same random gradients each
   step: every param's relative Frobenius difference ||muond - torch|| /
   ||torch|| must be <= 1e-2 (bf16 rounding).
2. A 200-step training run (an MLP regressing a fixed random teacher, fp32 on
   the GPU, same init and batches): the two loss curves must agree within
   5% relative at every step (noise of bf16 NS), and both must learn.
Exit code 0 = pass; prints a table. Needs a GPU; prints SKIP without one.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip  # noqa: E402

SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)


def llama_like(layers: int, hidden=1024, ffn=3584, kv=256):
    shapes = []
    for i in range(layers):
        shapes += [(f"l{i}.q", (hidden, hidden)), (f"l{i}.k", (kv, hidden)),
                   (f"l{i}.v", (kv, hidden)), (f"l{i}.o", (hidden, hidden)),
                   (f"l{i}.gate", (ffn, hidden)), (f"l{i}.up", (ffn, hidden)),
                   (f"l{i}.down", (hidden, ffn))]
    return shapes


def make_pair(tensors, address, job_id):
    from muond.torch import Muon as MuondMuon
    ref = [torch.nn.Parameter(t.clone()) for t in tensors]
    mine = [torch.nn.Parameter(t.clone()) for t in tensors]
    torch_opt = torch.optim.Muon(ref, adjust_lr_fn="original", **SETTINGS)
    muond_opt = MuondMuon([{"params": mine, "param_names": [f"p{i}" for i in range(len(mine))]}],
                          daemons=[address], job_id=job_id, coefficient_type="simple",
                          scale_mode="original", extra_scale_factor=1.0,
                          fp32_matmul_prec="medium", weight_decay_method="decoupled",
                          **SETTINGS)
    return ref, mine, torch_opt, muond_opt


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_llama(address, layers, steps) -> bool:
    shapes = llama_like(layers)
    g = torch.Generator(device="cuda").manual_seed(0)
    init = [0.02 * torch.randn(s, device="cuda", generator=g) for _, s in shapes]
    ref, mine, topt, mopt = make_pair(init, address, "exact-llama")
    try:
        for _ in range(steps):
            for r, m in zip(ref, mine):
                grad = 1e-3 * torch.randn(r.shape, device="cuda", generator=g)
                r.grad = grad.clone()
                m.grad = grad  # copied into the shared grad at step
            topt.step()
            mopt.step()
        torch.cuda.synchronize()
        diffs = [(name, shape, rel(m.data, r.data)) for (name, shape), r, m in
                 zip(shapes, ref, mine)]
        moved = [rel(r.data, i) for r, i in zip(ref, init)]
    finally:
        mopt.close()
    print(f"\n1. {steps} steps, {len(shapes)} Llama-like matrices: rel. Frobenius diff muond vs "
          "torch.optim.Muon (limit 1e-2)\n")
    print("| param | shape | rel diff | params moved (rel to init) |\n|---|---|---|---|")
    for (name, shape, d), mv in zip(diffs, moved):
        print(f"| {name} | {shape[0]}x{shape[1]} | {d:.2e} | {mv:.2e} |")
    worst = max(d for _, _, d in diffs)
    ok = worst <= 1e-2 and all(math.isfinite(d) for _, _, d in diffs)
    print(f"\nworst {worst:.3e}: {'PASS' if ok else 'FAIL'}")
    return ok


def check_training(address, steps) -> bool:
    torch.manual_seed(1)
    d_in, d_hid, d_out, batch = 256, 1024, 128, 512
    teacher = [torch.randn(d_hid, d_in, device="cuda") / 16, torch.randn(d_out, d_hid,
                                                                         device="cuda") / 32]
    init = [torch.randn(d_hid, d_in, device="cuda") / 16, torch.randn(d_out, d_hid,
                                                                      device="cuda") / 32]
    ref, mine, topt, mopt = make_pair(init, address, "exact-train")
    g = torch.Generator(device="cuda").manual_seed(2)
    curves = {"torch": [], "muond": []}
    try:
        for _ in range(steps):
            x = torch.randn(batch, d_in, device="cuda", generator=g)
            y = torch.tanh(x @ teacher[0].T) @ teacher[1].T
            for name, params, opt in (("torch", ref, topt), ("muond", mine, mopt)):
                opt.zero_grad()
                loss = ((torch.tanh(x @ params[0].T) @ params[1].T - y) ** 2).mean()
                loss.backward()
                opt.step()
                curves[name].append(loss.item())
    finally:
        mopt.close()
    t, m = curves["torch"], curves["muond"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(t, m))
    learned = t[-1] < 0.5 * t[0] and m[-1] < 0.5 * m[0]
    print(f"\n2. {steps}-step training run (MLP teacher regression): loss torch vs muond\n")
    print("| step | torch loss | muond loss |\n|---|---|---|")
    for s in sorted({0, 9, 49, 99, 149, steps - 1}):
        print(f"| {s + 1} | {t[s]:.5f} | {m[s]:.5f} |")
    ok = worst <= 0.05 and learned
    print(f"\nmax relative loss difference over {steps} steps {worst:.3e} (limit 5e-2), "
          f"learned {learned}: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
    if not cuda_or_skip():
        return 0
    # One daemon (and job) per check: each registers its own params once.
    with Daemon("exact-llama", log_dir=args.log_dir) as d:
        ok1 = check_llama(d.address, args.layers, args.steps)
    with Daemon("exact-train", log_dir=args.log_dir) as d:
        ok2 = check_training(d.address, args.train_steps)
    print(f"\nexactness vs torch.optim.Muon: {'PASS' if ok1 and ok2 else 'FAIL'}")
    return 0 if ok1 and ok2 else 1


if __name__ == "__main__":
    sys.exit(main())
