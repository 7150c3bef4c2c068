#!/usr/bin/env python3
"""Per-step overhead of the daemon path on the CPU (goal: "daemon path
within 1% of in-process", "Step RPC round trip with no work"): everything a
step costs that is not optimizer math.

Starts a muond-coordinator and one host-mode muond-daemon (shared memory, Unix
socket), registers muond.torch.Muon with (a) one 8x8 param, (b) 388 small
params (64x32, the MoE set's param count) or (c) 1000 groups of one 8x8
param each (per-layer groups at scale; --cases groups), and runs a few hundred steps,
each after --gap-ms of idle time (the trainer's forward and backward), once
over the Step RPC and once through the step channel (shared memory and a
futex), side by side (with --daemon-poll-ms also through the channel with
the daemon polling for each request, as a GPU daemon does). Per step it splits the client's wall time of
``opt.step()`` into

    client Python      = wall - rpc        (checks, overrides, the request)
    transport + server = rpc - daemon      (transport, handler, bookkeeping)
    daemon             = timings.total_us  (the step engine's phases)

and compares transport + server with gRPC's floor. With --daemon-poll-ms run it on an
otherwise idle host: a daemon thread polling with sched_yield waits for a core another
busy process holds, where one woken from the futex is scheduled at once (why host mode does
not poll by default). Also compared: a bare Health RPC on the
same socket (a handler that does nothing), back to back and after an idle gap
as long as a step's (both ends' gRPC threads sleep that long; waking them
costs extra). All figures p50 / p99 µs.

    bazel build //server/daemon:muond-daemon //server/coordinator:muond-coordinator
    .venv/bin/python bench/rpc_overhead.py --steps 500
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The checkout's client where its stubs are generated there (a GPU host's copy
# of them from the bundle); else the muond package deploy/setup.sh installed.
if os.path.exists(os.path.join(ROOT, "client", "python", "muond", "v1", "muond_pb2.py")):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

import torch  # noqa: E402

from muond.torch import Muon  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from daemon_harness import Daemon  # noqa: E402


# A request leg under this was read by a daemon thread already awake (polling):
# one woken from the futex after the trainer's idle takes ~0.1-0.2 ms on the
# development VM (bench/results/step_channel_cpu.md).
AWAKE_LEG_US = 80


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def fmt(values):
    return f"{pct(values, 0.5):7.0f} / {pct(values, 0.99):7.0f}"


def timed_calls(fn, n, warmup):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def run_case(job, shapes, steps, warmup, profile, step_channel=True, gap_s=0.0,
             group_each=False, daemon_poll_ms=0.0):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(0.02 * torch.randn(s)) for s in shapes]
    names = [f"p{i}" for i in range(len(params))]
    if group_each:  # a group per param, as per-layer groups
        groups = [{"params": [p], "param_names": [n], "name": f"g{i}"}
                  for i, (p, n) in enumerate(zip(params, names))]
    else:
        groups = [{"params": params, "param_names": names}]
    with Daemon(job, host=True,
                daemon_args=(f"--step_channel_request_poll_ms={daemon_poll_ms:g}",)) as d:
        opt = Muon(groups, lr=0.02, weight_decay=0.1, daemons=[d.address], job_id=job,
                   step_channel=step_channel)
        try:
            opt.zero_grad(set_to_none=False)  # .grad = the shared buffers (zero-copy)
            for p in params:
                p.grad.normal_(0, 1e-3)
            rows = []
            for i in range(warmup + steps):
                time.sleep(gap_s)  # the trainer's forward and backward
                t0 = time.perf_counter()
                opt.step()
                wall = (time.perf_counter() - t0) * 1e6
                if i >= warmup:
                    rows.append(dict(opt.last_timings, wall_us=wall))
            # The transport floor: a Health RPC (same channel, a handler that
            # does nothing), back to back and after an idle gap as long as the
            # trainer's gap plus the daemon's step (the daemon's gRPC threads
            # sleep that long; waking them costs extra).
            client = opt.clients[0]
            health_req = pb.HealthRequest()
            health = timed_calls(lambda: client.stub.Health(health_req), steps, warmup)
            gap = gap_s + pct([r["total_us"] for r in rows], 0.5) / 1e6

            def idle_health():
                time.sleep(gap)
                t0 = time.perf_counter()
                client.stub.Health(health_req)
                return (time.perf_counter() - t0) * 1e6
            idle = [idle_health() for _ in range(steps)]
            prof_text = None
            if profile:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(steps):
                    opt.step()
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
                prof_text = buf.getvalue()
        finally:
            opt.close()
    wall = [r["wall_us"] for r in rows]
    rpc = [r["rpc_us"] for r in rows]
    total = [r["total_us"] for r in rows]
    legs = {k: [r[k] for r in rows if k in r]
            for k in ("request_leg_us", "answer_leg_us", "handler_us")}
    return dict(wall=wall, rpc=rpc, total=total, legs=legs,
                client=[r["wall_us"] - r["rpc_us"] for r in rows],
                server=[r["rpc_us"] - r["total_us"] for r in rows],
                health=health, idle_health=idle, prof=prof_text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("MUOND_BIN", os.path.join(ROOT, "bazel-bin")))
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--many", "--params", dest="many", type=int, default=388,
                    help="params of case (b) (e.g. 10000: a large MoE's per-expert params)")
    ap.add_argument("--shape", default="64x32",
                    help="each param's shape in case (b), RxC (small: the overhead, not the math)")
    ap.add_argument("--groups", type=int, default=1000,
                    help="groups of case (c), one 8x8 param each (per-layer groups at scale)")
    ap.add_argument("--cases", default="one,many", help="which cases: one, many, groups")
    ap.add_argument("--profile", action="store_true", help="cProfile the client's step()")
    ap.add_argument("--gap-ms", type=float, default=20.0,
                    help="idle time before each step, as a trainer's forward and backward")
    ap.add_argument("--daemon-poll-ms", type=float, default=0.0,
                    help="also run the step channel with the daemon polling for each request "
                         "this long before it is due (--step_channel_request_poll_ms; a GPU daemon's "
                         "default is 1, a host daemon's 0)")
    a = ap.parse_args()
    os.environ["MUOND_BIN"] = a.bin  # the harness's binaries
    torch.set_num_threads(1)
    shape = tuple(int(n) for n in a.shape.split("x"))
    cases = [("one 8x8 param", [(8, 8)], False),
             (f"{a.many} params {a.shape}", [shape] * a.many, False),
             (f"{a.groups} groups of one 8x8 param", [(8, 8)] * a.groups, True)]
    import muond
    print(f"muond from {os.path.dirname(muond.__file__)}")
    print(f"{a.steps} steps per case after {a.warmup} warm-up; p50 / p99 µs\n")
    print(f"{a.gap_ms:g} ms idle before each step (the trainer's forward and backward)\n")
    print("| case | transport | step wall | client Python | Step call | transport + server "
          "| daemon total | Health RPC | Health RPC after idle gap | transport + server / "
          "idle Health (p50) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    profiles, splits = [], []
    cases = [c for c, key in zip(cases, ("one", "many", "groups")) if key in a.cases.split(",")]
    for k, (name, shapes, group_each) in enumerate(cases):
        ways = [(False, 0.0), (True, 0.0)] + ([(True, a.daemon_poll_ms)]
                                              if a.daemon_poll_ms > 0 else [])
        for w, (channel, poll_ms) in enumerate(ways):  # side by side, the same build
            r = run_case(f"rpcbench{os.getpid()}x{k}{w}", shapes, a.steps, a.warmup,
                         a.profile, step_channel=channel, gap_s=a.gap_ms / 1e3,
                         group_each=group_each, daemon_poll_ms=poll_ms)
            how = ("Step RPC" if not channel else "step channel" if poll_ms == 0
                   else f"step channel, daemon polls {poll_ms:g} ms")
            print(f"| {name} | {how} | {fmt(r['wall'])} | "
                  f"{fmt(r['client'])} | {fmt(r['rpc'])} | "
                  f"{fmt(r['server'])} | {fmt(r['total'])} | {fmt(r['health'])} | "
                  f"{fmt(r['idle_health'])} | "
                  f"{pct(r['server'], .5) / pct(r['idle_health'], .5):.2f} |", flush=True)
            if channel and r["legs"]["request_leg_us"]:
                splits.append((f"{name}, {how}", r))
            if r["prof"]:
                profiles.append((f"{name}, {how}", r["prof"]))
    if splits:
        # StepTimings.received_at_us / answered_at_us against the trainer's
        # readings of the same clock (muond.torch.Muon.last_timings).
        print("\nThe step channel's round trip, split: request leg (the trainer writes its "
              "request → the daemon has read and parsed it), the daemon's Step handler, the "
              "handler beyond the engine, answer leg (the daemon encodes its answer → the "
              "trainer has parsed it); p50 / p99 µs. Requests found awake: the share whose "
              f"leg is under {AWAKE_LEG_US} µs (a daemon thread woken from the futex takes "
              "longer here: the asleep row's p50)\n")
        print("| case | request leg | requests found awake | handler | handler beyond the "
              "engine | answer leg |")
        print("|---|---|---|---|---|---|")
        for name, r in splits:
            legs = r["legs"]
            beyond = [h - t for h, t in zip(legs["handler_us"], r["total"])]
            awake = sum(leg < AWAKE_LEG_US for leg in legs["request_leg_us"])
            print(f"| {name} | {fmt(legs['request_leg_us'])} | "
                  f"{awake} / {len(legs['request_leg_us'])} | {fmt(legs['handler_us'])} | "
                  f"{fmt(beyond)} | {fmt(legs['answer_leg_us'])} |")
    for name, text in profiles:
        print(f"\n== cProfile of step(), {name} ==\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
