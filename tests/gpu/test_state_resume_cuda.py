#!/usr/bin/env python3
"""muond.torch.Muon's state on a GPU (tag gpu): CUDA IPC regions,
the CUDA engine's state exported and imported through the Python client.

1. Resume: run A steps 6 times; run B steps 3 times, `torch.save`s
   `opt.state_dict()` into bytes and closes; a NEW optimizer over params
   restored from B's values loads it and steps 3 more times. B+C must equal A
   BITWISE (params of a Muon group and an AdamW group), and the loaded
   momentum must equal the saved one bitwise.
2. grad None: a param whose .grad is None at a step stays bitwise unchanged
   (torch.optim's rule) while the others move.
Both optimizers use muond's defaults (fp32_matmul_prec "medium", torch's
coefficients). Exit code 0 = pass. Needs a GPU; prints SKIP without one
(--host runs the same on a host-mode daemon and CPU tensors, to check the test).
"""
from __future__ import annotations

import io
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

DEVICE = "cpu" if "--host" in sys.argv else "cuda"
SHAPES = [(256, 512), (512, 256), (384, 384)]
ADAMW_SHAPES = [(512,), (64, 32)]


def make_params(seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    muon = [torch.nn.Parameter(0.02 * torch.randn(s, device=DEVICE, generator=g))
            for s in SHAPES]
    adamw = [torch.nn.Parameter(0.02 * torch.randn(s, device=DEVICE, generator=g))
             for s in ADAMW_SHAPES]
    return muon, adamw


def grads_for(step, params):
    g = torch.Generator(device=DEVICE).manual_seed(1000 + step)
    return [1e-3 * torch.randn(p.shape, device=DEVICE, generator=g) for p in params]


def optimizer(muon, adamw, address, job):
    from muond.torch import Muon
    return Muon([{"params": muon, "param_names": [f"w{i}" for i in range(len(muon))]},
                 {"params": adamw, "algorithm": "adamw", "lr": 3e-3, "betas": (0.9, 0.95),
                  "param_names": [f"a{i}" for i in range(len(adamw))]}],
                lr=0.02, daemons=[address], job_id=job)


def run(opt, params, steps, first):
    for s in range(first, first + steps):
        opt.zero_grad()
        for p, g in zip(params, grads_for(s, params)):
            p.grad = g
        opt.step()


def main() -> int:
    if DEVICE == "cuda" and not cuda_or_skip():
        return 0
    failures = []
    with Daemon("resume", host=DEVICE == "cpu") as d:
        muon, adamw = make_params(0)
        a = optimizer(muon, adamw, d.address, "resume")
        run(a, muon + adamw, 6, 0)
        want = [p.detach().clone() for p in muon + adamw]
        a.close()

        muon, adamw = make_params(0)
        b = optimizer(muon, adamw, d.address, "resume")
        run(b, muon + adamw, 3, 0)
        blob = io.BytesIO()
        torch.save(b.state_dict(), blob)
        saved_momentum = b.state[muon[0]]["momentum_buffer"].clone()
        values = [p.detach().clone() for p in muon + adamw]
        b.close()

        muon, adamw = make_params(1)  # other values, then B's restored
        with torch.no_grad():
            for p, v in zip(muon + adamw, values):
                p.copy_(v)
        c = optimizer(muon, adamw, d.address, "resume")
        blob.seek(0)
        c.load_state_dict(torch.load(blob))
        loaded = c.state[muon[0]]["momentum_buffer"]
        if not torch.equal(loaded.cpu(), saved_momentum.cpu()):
            failures.append("loaded momentum differs from the saved one")
        run(c, muon + adamw, 3, 3)
        for i, (p, w) in enumerate(zip(muon + adamw, want)):
            diff = float((p.detach() - w).abs().max())
            print(f"resume param {i} {tuple(p.shape)}: max |resumed - uninterrupted| = {diff:.3e}")
            if diff != 0.0:
                failures.append(f"resume param {i}: differs by {diff:.3e}")

        # grad None: w1 gets no gradient at the next step.
        before = [p.detach().clone() for p in muon]
        c.zero_grad()
        for i, (p, g) in enumerate(zip(muon + adamw, grads_for(99, muon + adamw))):
            if i != 1:
                p.grad = g
        c.step()
        if not torch.equal(muon[1].detach(), before[1]):
            failures.append("a param with grad None moved")
        if torch.equal(muon[0].detach(), before[0]):
            failures.append("a param with a gradient did not move")
        c.close()
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
