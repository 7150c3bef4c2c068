#!/usr/bin/env python3
"""Optimizer-state dtype and location through a CUDA daemon (tag gpu):

* host location (pinned host memory, streamed under the NS) steps bitwise as
  device location, fp32 and fp8_e4m3 state, ns_batch_size 1 and 4, and its
  state_dict is the same; the daemon reports the state's bytes on the host
  and none on the device;
* bf16 params with state_dtype auto keep a bf16 momentum, as torch.optim.Muon
  does for bf16 params: the two agree within bf16 rounding after a few steps
  (both NS in bf16), and the daemon reports bf16 state;
* fp8_e4m3 state (reported as such): after a few steps the params' change
  stays near fp32 state's (the momentum is stored with a 3-bit mantissa, each
  element within 2^-4 of itself: the orthogonalised update moves by a few
  percent, far below a wrong state's 100%), and a resumed fp8 optimizer
  (state_dict through torch.save) steps bitwise as the uninterrupted one.

Exit code 0 = pass; SKIP without a GPU.
"""
from __future__ import annotations

import io
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

SHAPES = [(512, 256), (256, 512), (384, 384), (384, 384), (384, 384), (96, 200)]
STEPS = 4
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)


def make(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((0.02 * torch.randn(s, generator=g)).to("cuda", dtype))
            for s in SHAPES]


def grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(1e-3 * torch.randn(s, generator=g)).to("cuda", dtype) for s in SHAPES]


def run(d, dtype=torch.float32, steps=STEPS, resume=None, **kw):
    """(final params, state_dict bytes, status) of `steps` steps from a fresh start, or
    from `resume` = (params, state_dict bytes, first step)."""
    from muond.torch import Muon
    ps = make(dtype)
    opt = Muon([{"params": ps, "param_names": [f"w{i}" for i in range(len(ps))]}],
               daemons=[d.address], job_id=d.job_id, fp32_matmul_prec="medium",
               **{**SETTINGS, **kw})
    try:
        first = 0
        if resume is not None:
            values, saved, first = resume
            with torch.no_grad():
                for p, v in zip(ps, values):
                    p.copy_(v.to("cuda"))
            opt.load_state_dict(torch.load(io.BytesIO(saved)))
        for s in range(first, first + steps):
            for p, g in zip(ps, grads(s, dtype)):
                p.grad = g
            opt.step()
        blob = io.BytesIO()
        torch.save(opt.state_dict(), blob)
        return [p.detach().cpu() for p in ps], blob.getvalue(), opt.clients[0].status()
    finally:
        opt.close()


def by_location(status) -> dict:
    return {(e.location, e.dtype): e.bytes for e in status.state_bytes_by}


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_host_equals_device(failures):
    for dtype in ("fp32", "fp8_e4m3"):
        for batch in (1, 4):
            with Daemon(f"gpu-state-{dtype}-{batch}") as d:
                dev, dev_state, _ = run(d, state_dtype=dtype, ns_batch_size=batch)
                host, host_state, status = run(d, state_dtype=dtype, ns_batch_size=batch,
                                               state_location="host")
            where = f"{dtype} ns_batch_size {batch}"
            for i, (a, b) in enumerate(zip(dev, host)):
                if not torch.equal(a, b):
                    failures.append(f"host != device ({where}) param w{i}: rel {rel(b, a):.3e}")
            if dev_state != host_state:
                dev_sd, host_sd = (torch.load(io.BytesIO(s)) for s in (dev_state, host_state))
                for k in dev_sd["state"]:
                    for name, v in dev_sd["state"][k].items():
                        if torch.is_tensor(v) and not torch.equal(v, host_sd["state"][k][name]):
                            failures.append(f"host != device ({where}) state {k}.{name}")
            got = by_location(status)
            on_device = sum(b for (loc, _), b in got.items() if loc == "device")
            on_host = sum(b for (loc, _), b in got.items() if loc == "host")
            if on_device != 0 or on_host <= 0:
                failures.append(f"host state ({where}) reported {got}: want bytes on the host "
                                "only")
    print("host location: bitwise as device (fp32, fp8_e4m3; ns_batch_size 1, 4)")


def check_bf16_auto_matches_torch(failures):
    # No weight decay: torch rounds p * (1 - lr wd) to bf16 apart from the
    # update (a decay below half an ulp is lost), muond once with it.
    with Daemon("gpu-state-bf16") as d:
        got, _, status = run(d, dtype=torch.bfloat16, weight_decay=0.0)
    dtypes = {dt for (_, dt) in by_location(status)}
    if dtypes != {"bf16"}:
        failures.append(f"bf16 params with state_dtype auto: state reported as {dtypes}")
    ps = make(torch.bfloat16)
    opt = torch.optim.Muon(ps, adjust_lr_fn="original", eps=1e-7,
                           **{**SETTINGS, "weight_decay": 0.0})
    for s in range(STEPS):
        for p, g in zip(ps, grads(s, torch.bfloat16)):
            p.grad = g
        opt.step()
    if opt.state[ps[0]]["momentum_buffer"].dtype != torch.bfloat16:
        failures.append("torch.optim.Muon's reference momentum is not bf16")
    init = make(torch.bfloat16)
    worst = 0.0
    for i, (a, b, p0) in enumerate(zip(got, ps, init)):
        # The update both applied, judged on its own size: bf16 momentum, NS and params.
        r = rel(a.float() - p0.cpu().float(), b.detach().cpu().float() - p0.cpu().float())
        worst = max(worst, r)
        if r > 0.05:
            failures.append(f"bf16 state vs torch.optim.Muon, param w{i}: update differs "
                            f"by {r:.3e} (> 0.05)")
    print(f"bf16 params, auto state: bf16, update within {worst:.3e} of torch.optim.Muon's")


def check_fp8(failures):
    with Daemon("gpu-state-fp8") as d:
        fp32, _, _ = run(d, state_dtype="fp32")
        fp8, _, status = run(d, state_dtype="fp8_e4m3")
        mid_params, mid_state, _ = run(d, state_dtype="fp8_e4m3", steps=2)
        resumed, _, _ = run(d, state_dtype="fp8_e4m3", steps=STEPS - 2,
                            resume=(mid_params, mid_state, 2))
    if {dt for (_, dt) in by_location(status)} != {"fp8_e4m3"}:
        failures.append(f"fp8 state reported as {by_location(status)}")
    init = make(torch.float32)
    worst = 0.0
    for i, (a, b, p0) in enumerate(zip(fp8, fp32, init)):
        r = rel(a - p0.cpu(), b - p0.cpu())
        worst = max(worst, r)
        if r > 0.25 or r == 0.0:
            failures.append(f"fp8 state, param w{i}: update differs from fp32 state's by "
                            f"{r:.3e} (want within 0.25, and not 0: fp8 rounds)")
    for i, (a, b) in enumerate(zip(resumed, fp8)):
        if not torch.equal(a, b):
            failures.append(f"fp8 state resumed, param w{i}: not bitwise the uninterrupted "
                            f"run (rel {rel(a, b):.3e})")
    print(f"fp8_e4m3 state: updates within {worst:.3e} of fp32 state's; resume bitwise")


def main() -> int:
    if not cuda_or_skip():
        return 0
    failures: list[str] = []
    check_host_equals_device(failures)
    check_bf16_auto_matches_torch(failures)
    check_fp8(failures)
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
