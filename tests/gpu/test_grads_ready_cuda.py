#!/usr/bin/env python3
"""The grads-ready event on a GPU (tag gpu): a trainer that does not
synchronise before its steps still has them read the grads it wrote.

1. Two optimizers on one daemon over equal params, stepped with equal
   grads: "event" (grads_ready_event=True, the default) and "synced"
   (False: the trainer synchronises). Each step's grads land in the shared
   grad buffers only after ~50 ms of GPU work queued before them (a stand-in
   for backward's tail; the copy is enqueued behind it), and step() is
   called at once. The daemon answered that it waits for the event, the
   event optimizer never synchronised, and its params equal the synced
   optimizer's bitwise after every step, while a step that read the grads
   before they landed would have read the last step's.
2. Bad handles (10 bytes; 64 bytes CUDA does not open) are refused at
   registration with an error naming grads_ready_event, and the daemon then
   registers and steps a good optimizer.
3. A trainer killed while its step waits for grads queued behind ~10 s of
   GPU work (its record never runs): the daemon refuses that step at once,
   naming why, stays up, and another trainer registers (taking over the dead
   one's registration) and steps.
Exit code 0 = pass. Needs a GPU; prints SKIP without one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

SHAPES = [(512, 1024), (1024, 512), (768, 768)]
STEPS = 4
# Clock cycles of torch.cuda._sleep ahead of each step's grads: ~50 ms at
# 2 GHz, far longer than a step's request takes to reach the daemon.
BACKWARD_TAIL_CYCLES = 100_000_000


def make_params():
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", generator=g))
            for s in SHAPES]


def grads_for(step):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return [1e-3 * torch.randn(s, device="cuda", generator=g) for s in SHAPES]


def optimizer(params, address, name, **kw):
    from muond.torch import Muon
    return Muon([{"params": params, "param_names": [f"w{i}" for i in range(len(params))]}],
                lr=0.02, daemons=[address], job_id="ready", name=name, **kw)


def step_with_late_grads(opt, params, grads):
    """The grads written behind ~50 ms of queued GPU work, then step() at
    once (the grads in place: zero_grad(set_to_none=False))."""
    opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(BACKWARD_TAIL_CYCLES)
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    opt.step()


def main() -> int:
    if not cuda_or_skip():
        return 0
    failures = []
    with Daemon("ready") as d:
        event_params, synced_params = make_params(), make_params()
        event = optimizer(event_params, d.address, "event")
        synced = optimizer(synced_params, d.address, "synced", grads_ready_event=False)
        if not event._grads_ready.daemons_wait:
            failures.append("the daemon did not answer that it waits for the event")
        if synced._grads_ready.daemons_wait:
            failures.append("grads_ready_event=False still records the event")
        start = [p.detach().clone() for p in event_params]
        for step in range(STEPS):
            grads = grads_for(step)
            with mock.patch.object(torch.cuda, "synchronize",
                                   side_effect=AssertionError("synchronised")) as sync:
                try:
                    step_with_late_grads_unsynced(event, event_params, grads)
                except AssertionError as e:
                    failures.append(f"step {step}: the event optimizer {e}")
                if sync.called:
                    failures.append(f"step {step}: the event optimizer synchronised")
            step_with_late_grads(synced, synced_params, grads)
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip(event_params, synced_params)):
                diff = float((a.detach() - b.detach()).abs().max())
                print(f"step {step} param {i}: max |event - synced| = {diff:.3e}")
                if diff != 0.0:
                    failures.append(f"step {step} param {i}: differs by {diff:.3e}")
        if any(torch.equal(p.detach(), s) for p, s in zip(event_params, start)):
            failures.append("a param did not move")
        event.close()
        synced.close()

        for handle, needle in [(b"\x01" * 10, "grads_ready_event: has 10 bytes"),
                               (b"\x01" * 64, "cudaIpcOpenEventHandle failed")]:
            with mock.patch("muond.torch.grads_ready.GradsReady.handle",
                            lambda self, regions, handle=handle: handle):
                try:
                    optimizer(make_params(), d.address, "bad").close()
                    failures.append(f"a {len(handle)}-byte handle was accepted")
                except Exception as e:  # noqa: BLE001 (the refusal is the point)
                    print(f"{len(handle)}-byte handle refused: {str(e)[:200]}")
                    if needle not in str(e):
                        failures.append(f"{len(handle)}-byte handle: {e!r} lacks {needle!r}")
        params = make_params()
        after = optimizer(params, d.address, "after")
        before = [p.detach().clone() for p in params]
        step_with_late_grads(after, params, grads_for(0))
        torch.cuda.synchronize()
        if any(torch.equal(p.detach(), b) for p, b in zip(params, before)):
            failures.append("after the refusals, a good optimizer's step moved nothing")
        after.close()
        killed_trainer(d, failures)
    return report(failures)


# A trainer whose second step's grads come behind ~10 s of GPU work.
DOOMED = r"""
import sys, torch
from muond.torch import Muon
p = [torch.nn.Parameter(0.02 * torch.randn(512, 1024, device="cuda"))]
opt = Muon([{"params": p, "param_names": ["w0"]}], lr=0.02, daemons=[sys.argv[1]],
           job_id="ready", name="doomed")
opt.zero_grad(set_to_none=False)
opt.step()
torch.cuda.synchronize()
torch.cuda._sleep(20_000_000_000)
p[0].grad.fill_(1e-3)
print("sending", flush=True)
opt.step()
print("the step returned", flush=True)
"""


def killed_trainer(d, failures):
    child = subprocess.Popen([sys.executable, "-c", DOOMED, d.address],
                             stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "sending":
        failures.append(f"the doomed trainer did not reach its step: {line!r}")
        child.kill()
        return
    time.sleep(0.5)  # the step sent, the daemon polling its event
    killed_at = time.time()
    child.send_signal(signal.SIGKILL)
    child.wait()
    needle = "never completed: its trainer ended first"
    while needle not in d.log() and time.time() - killed_at < 20:
        time.sleep(0.05)
    waited = time.time() - killed_at
    print(f"killed trainer: refusal logged {waited:.2f} s after the kill")
    if needle not in d.log():
        failures.append("the killed trainer's step was not refused within 20 s")
    elif waited > 5:
        failures.append(f"the killed trainer's step was refused only after {waited:.1f} s")
    if any(p.poll() is not None for p in d.procs):
        failures.append("a server exited after the trainer was killed")
        return
    params = make_params()
    try:
        again = optimizer(params, d.address, "doomed")  # the dead trainer's instance
        before = [p.detach().clone() for p in params]
        step_with_late_grads(again, params, grads_for(0))
        torch.cuda.synchronize()
        if any(torch.equal(p.detach(), b) for p, b in zip(params, before)):
            failures.append("after the killed trainer, a new trainer's step moved nothing")
        again.close()
    except Exception as e:  # noqa: BLE001
        failures.append(f"after the killed trainer, a new trainer failed: {e}")


def step_with_late_grads_unsynced(opt, params, grads):
    """step_with_late_grads for an optimizer that must not synchronise: the
    test's own synchronisation (before the queued work) goes around the
    patched torch.cuda.synchronize."""
    opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().synchronize()
    torch.cuda._sleep(BACKWARD_TAIL_CYCLES)
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    opt.step()


if __name__ == "__main__":
    sys.exit(main())
