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

import gc
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


def free_gib() -> str:
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
    return (f"{torch.cuda.mem_get_info()[0] / GIB:.1f} GiB free (this process: "
            f"{torch.cuda.memory_allocated() / GIB:.1f} allocated, "
            f"{torch.cuda.memory_reserved() / GIB:.1f} reserved; by process: "
            + "; ".join(apps.split("\n")) + ")" + cached_segments())


def cached_segments() -> str:
    """torch's segments holding free blocks (what empty_cache could not
    return), for a failure's context."""
    rows = [f"{seg['total_size'] / GIB:.2f} GiB segment, {seg['allocated_size'] / GIB:.2f} "
            f"allocated, stream {seg['stream']}, blocks "
            + ",".join(f"{b['size'] / GIB:.2f}:{b['state']}" for b in seg["blocks"])
            for seg in torch.cuda.memory_snapshot()
            if seg["total_size"] - seg["allocated_size"] > GIB]
    return (" cached: " + " | ".join(rows)) if rows else ""


def release() -> None:
    """What this process no longer uses goes back to the device: an
    optimizer's CUDA allocations are freed when collected (it may sit in a
    reference cycle), torch's cached blocks when emptied."""
    gc.collect()
    torch.cuda.empty_cache()


def hold(nbytes: int) -> subprocess.Popen:
    """Another process holding `nbytes` of the GPU until killed."""
    if nbytes <= 0:
        raise RuntimeError(f"no room for another process: {free_gib()} after the "
                           "registration, and the test leaves 6 GiB to the daemon")
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
    # The registration moved the param into the shared buffer: its old
    # storage goes back to the device, and the copy to compare with lives
    # on the host (an 80 GB GPU holds the param, its grad, the shared param
    # and grad and the daemon's momentum, 5 x 11.7 GB, and no more copies).
    torch.cuda.empty_cache()
    before = param.detach().cpu()
    print(f"  registered: {free_gib()}", flush=True)
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
        del opt
        release()
    changed = not torch.equal(before, param.detach().cpu())
    return changed and bool(torch.isfinite(param).all()), status


def main() -> int:
    if not cuda_or_skip():
        return 0
    failures = []
    g = torch.Generator(device="cuda").manual_seed(0)
    param = torch.nn.Parameter(0.02 * torch.randn(EXPERTS, ROWS, COLS, device="cuda",
                                                  generator=g))
    grad = 1e-3 * torch.randn(EXPERTS, ROWS, COLS, device="cuda", generator=g)
    release()  # randn's temporaries
    total = torch.cuda.mem_get_info()[1]
    print(f"device {total / GIB:.0f} GiB; another process holds all but "
          f"{ROOM / GIB:.0f} GiB once the daemon registered")
    for batch in (1, 0, 64, 256):  # 0: auto, 18 of these a batch
        release()  # the last case's copies (close() hands the param and grad back)
        print(f"ns_batch_size {batch}: {free_gib()} before the daemon starts", flush=True)
        with Daemon(f"nsmem-{batch}") as d:
            try:
                ok, status = step_twice(d, batch, param, grad, room=ROOM)
            except Exception as e:  # noqa: BLE001
                failures.append(f"ns_batch_size {batch}: {e}")
                print(f"ns_batch_size {batch}: failed: {str(e)[-300:]}", flush=True)
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
    release()
    print(f"cap {cap}: {free_gib()} before the daemon starts", flush=True)
    with Daemon("nsmem-cap", daemon_args=(f"--max_ns_workspace_bytes={cap}",)) as d:
        try:
            ok, status = step_twice(d, 64, param, grad)
            print(f"cap {cap}: stepped {ok}, peak {status.peak_ns_workspace_bytes}")
            if not ok or not 0 < status.peak_ns_workspace_bytes <= cap:
                failures.append(f"cap {cap}: peak {status.peak_ns_workspace_bytes}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"cap {cap}: {e}")
    release()
    with Daemon("nsmem-none", daemon_args=(
            f"--max_ns_workspace_bytes={ONE_WORKSPACE // 2}",)) as d:
        before = param.detach().cpu()
        try:
            step_twice(d, 64, param, grad)
            failures.append("a cap below one workspace did not refuse the step")
        except Exception as e:  # noqa: BLE001
            message = str(e)
            print(f"cap below one matrix: {message.splitlines()[0][:300]}")
            if not ("RESOURCE_EXHAUSTED" in message and "2048x7168" in message
                    and "bytes needed" in message):
                failures.append(f"the refusal does not name the numbers: {message[:400]}")
        if not torch.equal(before, param.detach().cpu()):
            failures.append("a refused step changed the params")
    return report(failures)


if __name__ == "__main__":
    sys.exit(main())
