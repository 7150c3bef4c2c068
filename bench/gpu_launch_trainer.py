"""The GPU check of `muond launch` (bench/gpu_launch_cuda.sh): one torchrun rank on CUDA.

Trains a small MLP's matrices with muond.torch.Muon (its daemon found from the environment
`muond launch` exports; CUDA IPC handles) and, side by side in this process, a copy with
torch.optim.Muon (same hyperparameters and gradients, bf16 NS operands as torch). Mid-run it
asks its daemon's grpc.health.v1 (expects SERVING) and scrapes /metrics of the coordinator
(--metrics-port P) and its daemon (P+1+LOCAL_RANK); after close() the daemon must be
NOT_SERVING again. Writes a JSON summary to --out; exits 1 when a check fails.
"""
import argparse
import json
import os
import sys
import time
import urllib.request

import torch

from muond import health as muond_health
from muond.torch import Muon


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def health(address):
    try:
        return muond_health.check(address, service="", timeout=5.0)
    except Exception as e:  # noqa: BLE001 - reported in the summary
        return f"error: {e}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    shapes = [(256, 512), (512, 256), (256, 128)]
    ws = [torch.randn(s, device=dev) / s[1] ** 0.5 for s in shapes]
    mine = [torch.nn.Parameter(w.clone()) for w in ws]
    ref = [torch.nn.Parameter(w.clone()) for w in ws]
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
    # As tests/gpu/test_exactness_vs_torch.py: bf16 operands (torch's NS dtype), the same
    # gradients given to both, relative norm difference <= 1e-2 (bf16 rounding).
    opt = Muon(mine, fp32_matmul_prec="medium", weight_decay_method="decoupled",
               adjust_lr_fn="original", **kw)
    ref_opt = torch.optim.Muon(ref, adjust_lr_fn="original", **kw)
    job = os.environ["MUOND_JOB_ID"]
    rank = int(os.environ.get("RANK", "0"))
    sock = f"unix://{os.environ['MUOND_SOCKET_DIR']}/muond-{job}-{rank}.sock"
    out = {"job": job, "daemon": sock}
    x = torch.randn(64, 256, device=dev)
    for step in range(a.steps):
        opt.zero_grad()
        h = x
        for w in mine:
            h = torch.tanh(h @ w)
        h.square().mean().backward()
        for m, r in zip(mine, ref):
            r.grad = m.grad.clone()
        opt.step()
        ref_opt.step()
        if step == a.steps // 2:
            out["health_mid"] = health(sock)
    torch.cuda.synchronize()
    out["daemon_metrics"] = {k: v for k, v in scrape(a.metrics_port + 1 + int(
        os.environ.get("LOCAL_RANK", "0"))).items() if k.startswith(
        ("muond_steps", "muond_step_phase_seconds_count", "muond_ns_load", "muond_plan_version",
         "muond_registered_params", "muond_build_info"))}
    out["coordinator_metrics"] = {k: v for k, v in scrape(a.metrics_port).items()
                                  if k.startswith(("muond_coordinator", "muond_build_info"))}
    diffs = [((m.double() - r.double()).norm() / r.double().norm()).item()
             for m, r in zip(mine, ref)]
    out["max_rel_diff_vs_torch_muon"] = max(diffs)
    opt.close()
    # The daemon's readiness follows its engine on its own thread: allow it a moment.
    for _ in range(50):
        out["health_after_close"] = health(sock)
        if out["health_after_close"] == "NOT_SERVING":
            break
        time.sleep(0.1)
    dm = out["daemon_metrics"]
    checks = {
        "serving_mid_run": out["health_mid"] == "SERVING",
        "steps_applied": dm.get("muond_steps_applied_total") == a.steps,
        "phase_counts": all(v == a.steps for k, v in dm.items()
                            if k.startswith("muond_step_phase_seconds_count")),
        "matches_torch_muon": out["max_rel_diff_vs_torch_muon"] <= 1e-2,
        "not_serving_after_close": out["health_after_close"] == "NOT_SERVING",
    }
    out["checks"] = checks
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
