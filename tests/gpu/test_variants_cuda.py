#!/usr/bin/env python3
"""NorMuon and AdaMuon on the CUDA engine (tag gpu): the same params and grads
stepped by a CUDA daemon and by a host-mode daemon (the CPU backend, whose
variants the contract suite checks against a float64 reference) must agree
within fp32 rounding, with NS in fp32 (fp32_matmul_prec "highest") so that
only the backends' summation orders differ; the second moments too. A param
whose grad is all zero must stay finite (no NaN from the renormalisation),
and a resumed optimizer (state_dict through torch.save) must step as the
uninterrupted one, bitwise. Exit code 0 = pass; SKIP without a GPU.
"""
from __future__ import annotations

import io
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

SHAPES = [(256, 128), (96, 320), (64, 64)]
STEPS = 4
REL_TOL = 1e-4  # CUDA vs CPU backend, fp32 NS: reduction orders only
# AdaMuon divides each element by its own RMS: near-zero NS outputs come out
# near +-1/sqrt(1 - beta2) either way, so a rounding difference can flip one.
# Nearly every element agrees to REL_TOL; the few that do not stay bounded.
ADAMUON_AGREE, ADAMUON_MAX_REL = 0.99, 1e-2


def make(device):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((0.02 * torch.randn(s, generator=g)).to(device))
            for s in SHAPES]


def grads(step, device):
    g = torch.Generator().manual_seed(100 + step)
    out = [1e-3 * torch.randn(s, generator=g) for s in SHAPES]
    out[2] = torch.zeros(SHAPES[2])  # an all-zero grad: the update must stay finite
    return [t.to(device) for t in out]


def run(d, device, variant, steps=STEPS, state=None):
    from muond.torch import Muon
    ps = make(device)
    opt = Muon([{"params": ps, "param_names": [f"w{i}" for i in range(len(ps))]}],
               lr=0.02, daemons=[d.address], job_id=d.job_id, variant=variant,
               fp32_matmul_prec="highest")
    try:
        if state is not None:
            values, saved = state
            with torch.no_grad():
                for p, v in zip(ps, values):
                    p.copy_(v.to(device))
            opt.load_state_dict(torch.load(io.BytesIO(saved)))
        first = 0 if state is None else STEPS - steps
        for s in range(first, first + steps):
            for p, g in zip(ps, grads(s, device)):
                p.grad = g
            opt.step()
        blob = io.BytesIO()
        torch.save(opt.state_dict(), blob)
        states = {k: [opt.state[p][k].detach().cpu() for p in ps] for k in opt.state[ps[0]]}
        return [p.detach().cpu() for p in ps], states, blob.getvalue()
    finally:
        opt.close()


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> int:
    if not cuda_or_skip():
        return 0
    failures = []
    for variant in ("normuon", "adamuon"):
        with Daemon(f"gpu-{variant}") as d:
            got, got_state, _ = run(d, "cuda", variant)
            half, _, saved = run(d, "cuda", variant, steps=STEPS // 2)
            resumed, _, _ = run(d, "cuda", variant, steps=STEPS - STEPS // 2,
                                state=(half, saved))
        with Daemon(f"host-{variant}", host=True) as d:
            want, want_state, _ = run(d, "cpu", variant)
        for i, (a, b) in enumerate(zip(got, want)):
            r = rel(a, b)
            close = float(((a - b).abs() <= REL_TOL * b.abs().max()).float().mean())
            print(f"{variant} w{i} {SHAPES[i]}: rel |cuda - host| = {r:.2e}, elements within "
                  f"{REL_TOL:g}: {close:.4%}, finite {bool(torch.isfinite(a).all())}")
            ok = r < REL_TOL if variant == "normuon" else (
                close >= ADAMUON_AGREE and r < ADAMUON_MAX_REL)
            if not (ok and torch.isfinite(a).all()):
                failures.append(f"{variant} w{i}: cuda vs host {r:.2e}, {close:.4%} close")
        for key in got_state:
            r = max(rel(a, b) for a, b in zip(got_state[key], want_state[key]))
            print(f"{variant} state {key}: rel |cuda - host| = {r:.2e}")
            if not r < REL_TOL:
                failures.append(f"{variant} state {key}: cuda vs host {r:.2e}")
        if not all(torch.equal(a, b) for a, b in zip(resumed, got)):
            failures.append(f"{variant}: the resumed run differs from the uninterrupted one")
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
