#!/usr/bin/env python3
"""An optimizer's CUDA buffers are freed at its end (tag gpu): 10 cycles of
create -> 2 steps -> close() -> del and 10 of create -> 2 steps -> del (the
cyclic garbage collector off: reference counting alone ends the optimizer)
leave torch.cuda.memory_allocated() and the device's free memory
(cudaMemGetInfo, which also sees the daemon's IPC mappings) at their baseline,
the model's params and grads keep their values when they move out of the
optimizer's buffers, and the trainer exits without torch's "Producer process
has been terminated before all shared CUDA tensors released" warning (memory
shared through torch's IPC reference counting, which a daemon never releases).

The cycles run in a child process whose stderr is checked. The model (64 MiB
of fp32 params and a bf16 one) lives across the cycles; the baseline is taken
after one warm-up cycle (CUDA context, cuBLAS workspaces, the model's grads
moved to memory of their own). Exit code 0 = pass. Needs a GPU; prints SKIP
without one. ``--child`` runs the cycles and prints the memory per round;
``--child --collect`` runs them with gc.collect() after each drop (to measure a
client whose optimizers need the cyclic collector).
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip  # noqa: E402

CYCLES = 10
MIB = 1 << 20
# What may differ from the baseline after a cycle: torch's and the daemon's
# bookkeeping, far below one cycle's buffers (params + grads: 130 MiB).
ALLOCATED_SLACK, FREE_SLACK = 2 * MIB, 8 * MIB
PRODUCER_WARNING = "Producer process has been terminated"


def make_params(torch):
    g = torch.Generator(device="cuda").manual_seed(0)
    fp32 = [torch.nn.Parameter(0.02 * torch.randn(2048, 2048, device="cuda", generator=g))
            for _ in range(4)]
    bf16 = [torch.nn.Parameter(0.02 * torch.randn(256, 512, device="cuda", generator=g)
                               .to(torch.bfloat16))]
    return fp32, bf16


def cycle(torch, address: str, params, close: bool) -> list[str]:
    """One optimizer's life; what went wrong with the model's tensors."""
    from muond.torch import Muon
    fp32, bf16 = params
    opt = Muon([{"params": fp32}, {"params": bf16, "algorithm": "adamw", "lr": 3e-3}],
               lr=0.02, daemons=[address], job_id="memory")
    for _ in range(2):
        for p in fp32 + bf16:
            p.grad = 1e-3 * torch.randn_like(p)
        opt.step()
    # The model keeps its values and grads when its memory moves out.
    values = [(p.detach().clone(), p.grad.clone()) for p in fp32 + bf16]
    if close:
        opt.close()
    del opt
    if "--collect" in sys.argv:
        gc.collect()
    return [f"param {i} {what} changed at the optimizer's end"
            for i, (p, (value, grad)) in enumerate(zip(fp32 + bf16, values))
            for what, a, b in (("value", p.detach(), value), ("grad", p.grad, grad))
            if not torch.equal(a, b)]


def memory(torch) -> tuple[int, int]:
    """(torch.cuda.memory_allocated, cudaMemGetInfo's free bytes)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


def child() -> int:
    import torch
    if "--collect" not in sys.argv:
        gc.disable()
    failures = []
    with Daemon("memory") as d:
        params = make_params(torch)
        failures += cycle(torch, d.address, params, close=True)
        base_alloc, base_free = memory(torch)
        print(f"baseline: allocated {base_alloc / MIB:.1f} MiB, free {base_free / MIB:.1f} MiB")
        for close in (True, False):
            for i in range(CYCLES):
                failures += cycle(torch, d.address, params, close)
                alloc, free = memory(torch)
                what = f"{'close()' if close else 'del only'} round {i + 1}"
                print(f"{what}: allocated {(alloc - base_alloc) / MIB:+.1f} MiB, "
                      f"free {(free - base_free) / MIB:+.1f} MiB", flush=True)
                if abs(alloc - base_alloc) > ALLOCATED_SLACK:
                    failures.append(f"{what}: memory_allocated {alloc - base_alloc:+d} bytes")
                if abs(free - base_free) > FREE_SLACK:
                    failures.append(f"{what}: free device memory {free - base_free:+d} bytes")
        # The model still trains on after its optimizers are gone.
        for p in params[0] + params[1]:
            if not torch.isfinite(p.float()).all():
                failures.append("a param is not finite after the cycles")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


def main() -> int:
    if "--child" in sys.argv:
        return child()
    if not cuda_or_skip():
        return 0
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"],
                         capture_output=True, text=True, timeout=600)
    print(run.stdout, end="")
    print(run.stderr, end="", file=sys.stderr)
    if run.returncode != 0:
        print(f"FAIL: the cycles exited with {run.returncode}")
        return 1
    if PRODUCER_WARNING in run.stderr:
        print(f"FAIL: the trainer warned at exit: {PRODUCER_WARNING} ...")
        return 1
    print("PASS: every round at the baseline, no shared CUDA tensor left at exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
