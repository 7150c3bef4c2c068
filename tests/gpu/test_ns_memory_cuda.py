#!/usr/bin/env python3
"""Newton–Schulz workspaces sized by free device memory (tag gpu). While
another process holds most of the GPU, an MoE layer of 200 experts of
2048 x 7168 (one [200, 2048, 7168] param) steps at ns_batch_size 1, 0 (auto), 64 and
256 without running out of memory: the daemon runs the batches its free
memory holds (its log says so at 64 and 256), GetStatus reports the
workspace bytes, below what was free, and every step changes the params and
keeps them finite. With --max_ns_workspace_bytes the workspaces stay under
the cap. When not even one matrix fits (the cap below one workspace) the step
is refused RESOURCE_EXHAUSTED naming the numbers, params unchanged. Exit code
0 = pass; SKIP without a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import Daemon, cuda_or_skip, report  # noqa: E402

EXPERTS, ROWS, COLS = 200, 2048, 7168
GIB = 1 << 30
# Free memory left at the first step: the reserve the budget keeps (2% of
# the device, 2.8 GiB on an H200) and about 3 GiB of workspace, some 40
# matrices' (75 MiB each in bf16), well under a batch of 64.
ROOM = 6 * GIB
ONE_WORKSPACE = 2 * ROWS * COLS * 2 + 2 * ROWS * ROWS * 2  # bf16 standard NS


def hold(nbytes: int) -> subprocess.Popen:
    """Another process holding `nbytes` of the GPU until killed."""
    code = ("import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, "
            "device='cuda'); print('held', flush=True); time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(nbytes)], stdout=subprocess.PIPE,
                            text=True)
    if proc.stdout.readline().strip() != "held":
        raise RuntimeError("the holder process did not allocate")
    return proc


def step_twice(d, batch, param, grad, room=None):
    """Two steps of `param` through daemon `d`; with `room`, another process
    holds all but `room` bytes of the GPU from after the registration (the
    daemon's state and buffers allocated) until the steps are done: the NS
    workspaces, built at the first step, get what is left."""
    from muond.torch import Muon
    opt = Muon([{"params": [param], "param_names": ["experts"]}], lr=0.02,
               daemons=[d.address], job_id=d.job_id, ns_batch_size=batch)
    before = param.detach().clone()
    held = None
    try:
        if room is not None:
            held = hold(torch.cuda.mem_get_info()[0] - room)
        for _ in range(2):
            param.grad = grad
            opt.step()
        torch.cuda.synchronize()
        status = opt.clients[0].status()  # the optimizer's own instance
    finally:
        if held is not None:
            held.kill()
            held.wait()
        opt.close()
        # close() hands the shared grad back as a copy in torch's allocator:
        # dropped, and the cache emptied, so that the next optimizer's own
        # cudaMalloc'ed buffers find the memory (on an 80 GB GPU they did not).
        param.grad = None
        torch.cuda.empty_cache()
    changed = not torch.equal(before, param.detach())
    return changed and bool(torch.isfinite(param).all()), status


def main() -> int:
    if not cuda_or_skip():
        return 0
    failures = []
    g = torch.Generator(device="cuda").manual_seed(0)
    param = torch.nn.Parameter(0.02 * torch.randn(EXPERTS, ROWS, COLS, device="cuda",
                                                  generator=g))
    grad = 1e-3 * torch.randn(EXPERTS, ROWS, COLS, device="cuda", generator=g)
    total = torch.cuda.mem_get_info()[1]
    print(f"device {total / GIB:.0f} GiB; another process holds all but "
          f"{ROOM / GIB:.0f} GiB once the daemon registered")
    for batch in (1, 0, 64, 256):  # 0: auto, 18 of these a batch
        print(f"ns_batch_size {batch}: {torch.cuda.mem_get_info()[0] / GIB:.1f} GiB free "
              "before the daemon starts", flush=True)
        with Daemon(f"nsmem-{batch}") as d:
            try:
                ok, status = step_twice(d, batch, param, grad, room=ROOM)
            except Exception as e:  # noqa: BLE001
                failures.append(f"ns_batch_size {batch}: {e}")
                continue
            split = "run in batches of" in d.log()
            print(f"ns_batch_size {batch}: stepped {ok}, NS workspace "
                  f"{status.peak_ns_workspace_bytes / GIB:.2f} GiB (peak), "
                  f"batches split: {split}")
            if not ok:
                failures.append(f"ns_batch_size {batch}: params unchanged or not finite")
            if not 0 < status.peak_ns_workspace_bytes < ROOM:
                failures.append(f"ns_batch_size {batch}: workspace "
                                f"{status.peak_ns_workspace_bytes} not in (0, {ROOM})")
            if batch >= 64 and not split:
                failures.append(f"ns_batch_size {batch}: no smaller batch was logged")
    cap = 3 * ONE_WORKSPACE
    with Daemon("nsmem-cap", daemon_args=(f"--max_ns_workspace_bytes={cap}",)) as d:
        ok, status = step_twice(d, 64, param, grad)
        print(f"cap {cap}: stepped {ok}, peak {status.peak_ns_workspace_bytes}")
        if not ok or not 0 < status.peak_ns_workspace_bytes <= cap:
            failures.append(f"cap {cap}: peak {status.peak_ns_workspace_bytes}")
    with Daemon("nsmem-none", daemon_args=(
            f"--max_ns_workspace_bytes={ONE_WORKSPACE // 2}",)) as d:
        before = param.detach().clone()
        try:
            step_twice(d, 64, param, grad)
            failures.append("a cap below one workspace did not refuse the step")
        except Exception as e:  # noqa: BLE001
            message = str(e)
            print(f"cap below one matrix: {message.splitlines()[0][:300]}")
            if not ("RESOURCE_EXHAUSTED" in message and "2048x7168" in message
                    and "bytes needed" in message):
                failures.append(f"the refusal does not name the numbers: {message[:400]}")
        if not torch.equal(before, param.detach()):
            failures.append("a refused step changed the params")
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
