#!/usr/bin/env python3
"""One Muon optimizer step over shape sets on one GPU, every contender in one process and
run, fp32 params and grads, median of --reps steps, --rounds rounds:

  torch        torch.optim.Muon on identical copies of the params and grads;
  peer_a       gram-newton-schulz 0.1.6's Muon (Dao-AILab; CuTe DSL kernels from
               quack-kernels, torch.compile'd, CUDA graphs) with the same coefficients as
               everyone: torch's (3.4445, -4.775, 2.0315) x 5, Gram NS, standard NS for square,
               its restart tuner's pick for them ([3]) unless --peer-restarts;
  peer_b       the same with its defaults: Polar Express coefficients, tuned restart ([2]);
  inproc_std   muond in-process (bench/gpu:step_bench --engine: the daemon's step engine,
  inproc_gram    LayerShardedMuon::Step with its non-finite check) with standard / Gram NS;
  inproc_gram_double_buffered  the same with double_buffer_momentum (not among the
                               default columns);
  daemon_std   muond through the daemon (muond.torch.Muon: Python client, CUDA IPC, the step
  daemon_gram    channel), standard / Gram NS (ns_algorithm="gram");
  daemon_gram_checks_first  the same with overlap_checks off: step() checks, then sends;
  daemon_gram_grpc          the same over the Step RPC (a Unix socket);
  daemon_gram_asleep        the same with neither end polling: the trainer asleep until
                            the answer (step_channel_poll_ms=0), the daemon until the
                            request (--step_channel_request_poll_ms=0); not among the default
                            columns;
  daemon_gram_double_buffered  the same with double_buffer_momentum (not among the
                               default columns).

The same math everywhere otherwise: eps 1e-7, `original` scale (the peer gets it as its
adjust_lr callable), Nesterov, momentum 0.95, decoupled weight decay 0.1 (the peer scales it
by the base lr, as torch does). What the peer does differently: its momentum is
M = mu M + G, U = mu M + G (torch's and muond's: M = lerp(M, G, 1 - mu), U = lerp(G, M, mu)
= (1 - mu) x the peer's U); NS normalises U to unit Frobenius norm first, so the NS input is
the same up to eps (X / (|X| + eps) there, X / max(|X|, eps) here); it iterates in fp16
(muond's Gram: fp16 by default; torch and muond's standard NS: bf16); its gram iteration
is for every non-square shape (muond: aspect >= gram_min_aspect_ratio).

Timings: host clock around the step with the device synchronised (torch and the peer:
synchronize after step; muond.torch synchronises before its RPC and the daemon before it
answers). The peer compiles (torch.compile, CuTe DSL JIT) on first use of each shape: its
first step is timed apart ("first step s") and it is warmed up until two steps agree within
3%. Its two NS objects live for the whole process, so later sets reuse their compiled code.
Also: the Step RPC round trip with (almost) no work, one 8x8 param: p50/p99 us.
--backward-tail-ms X: each timed step (torch, peer and daemon columns) starts behind X ms of
GPU work queued on the current stream (torch.cuda._sleep), a stand-in for backward's last
kernels, as a training loop calls step() while backward's last kernels run: what a step costs
beyond backward is its time less X (muond.torch synchronises before its request; torch and the
peer queue their kernels behind that work).
--kernel-profile DIR: per torch, peer and in-process column, each kernel's GPU time summed
over one more run of --reps steps (the daemon's engine is the in-process one), e.g.

    MUOND_BIN=<bundle>/bin python3 bench/gpu_step_bench.py --set llama3_8b:4:4 --rounds 1 \\
        --columns torch,inproc_gram --no-rpc --kernel-profile prof/

(without MUOND_BIN: `bazel build -c opt //bench/gpu:step_bench //bench/gpu:libkernel_profile.so`,
both from the same bazel-bin).
--gpu-clocks: per round and column, the GPU's median SM clock and power draw while it was busy
(nvidia-smi every 100 ms): a GPU at its power limit runs its GEMMs below the boost clock, and
machines of one kind differ in it (results/gpu_h100_sym_gemm_epilogue.md).

Per set: each column's ms, the target ratios (GOALS), and per column the effective NS
TFLOP/s (standard-NS FLOPs 5 (4 m^2 n + 2 m^3) / time, the same numerator for everyone) and
the fraction of the FLOP ceiling of the algorithm the column actually runs
(ideal_ns_flops: symmetric products at half price / time / 989 TFLOP/s, the H200's dense
bf16/fp16 peak).

    MUOND_BIN=<bundle>/bin python3 bench/gpu_step_bench.py \\
        --set llama3_8b:4:4 --set qwen3_1_7b:28:28 --set qwen3_30b_a3b:1:256 --out table.md
    python3 bench/gpu_step_bench.py --sweep-aspect --out sweep.md   # standard vs Gram NS
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from gpu_step_flops import (default_gram_min_aspect, default_gram_restarts,  # noqa: E402,F401
                            ideal_ns_flops, standard_ns_flops)

SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5)
TORCH_COEFFICIENTS = (3.4445, -4.775, 2.0315)
H200_DENSE_PEAK = 989e12  # bf16/fp16 dense tensor-core FLOP/s, the H200 data sheet
COLUMNS = ["torch", "peer_a", "peer_b", "inproc_std", "inproc_gram",
           "inproc_gram_double_buffered", "daemon_std",
           "daemon_gram", "daemon_gram_checks_first", "daemon_gram_grpc", "daemon_gram_asleep",
           "daemon_gram_double_buffered"]
# Asked for by name only: not what a user runs by default.
OPT_IN_COLUMNS = ("daemon_gram_asleep", "inproc_gram_double_buffered",
                  "daemon_gram_double_buffered")
TITLES = {"torch": "torch.optim.Muon", "peer_a": "peer (a) same coeffs",
          "peer_b": "peer (b) defaults", "inproc_std": "muond in-process std",
          "inproc_gram": "muond in-process gram",
          "inproc_gram_double_buffered": "muond in-process gram, double-buffered momentum",
          "daemon_std": "muond daemon std",
          "daemon_gram": "muond daemon gram",
          "daemon_gram_checks_first": "muond daemon gram, checks first",
          "daemon_gram_grpc": "muond daemon gram, Step RPC",
          "daemon_gram_asleep": "muond daemon gram, neither end polling",
          "daemon_gram_double_buffered": "muond daemon gram, double-buffered momentum"}
# Speed targets, muond gram through the daemon: x faster than (peer a, peer b, torch).
# The targets per set: (vs peer (a), vs peer (b), vs torch.optim.Muon); None: no target.
GOALS = {"llama3_8b": (1.3, 1.3, 2.3), "qwen3_1_7b": (1.3, 1.3, 2.3),
         "qwen3_30b_a3b": (1.5, 1.5, None)}
# The daemon's step over the in-process engine's, every set.
DAEMON_OVER_INPROCESS_GOAL = 1.01
# name: (layers, muond ns_batch_size); 0 = muond's default (auto by shape), which batches
# what bench/results/gpu_h200.md measured best batched (Qwen3-1.7B, the MoE experts) and runs
# Llama-3-8B's 4096-wide matrices one at a time.
SET_DEFAULTS = {"llama3_8b": (4, 0), "qwen3_1_7b": (28, 0), "qwen3_30b_a3b": (1, 0)}


# ---------------------------------------------------------------------------- shapes
def shape_set(manifest: str, layers: int):
    params = json.load(open(manifest))["params"]
    keep = [p for p in params if len(p["shape"]) == 2 and
            (m := re.match(r"layers\.(\d+)\.", p["name"])) and int(m.group(1)) < layers]
    return [tuple(p["shape"]) for p in keep]


def parse_set(text: str):
    """NAME_OR_MANIFEST[:LAYERS[:NS_BATCH]] -> (name, manifest path, layers, ns_batch)."""
    parts = text.split(":")
    path = parts[0] if parts[0].endswith(".json") else \
        os.path.join(ROOT, "bench/manifests", parts[0] + ".json")
    name = os.path.basename(path)[:-5]
    layers, batch = SET_DEFAULTS.get(name, (4, 0))
    if len(parts) > 1:
        layers = int(parts[1])
    if len(parts) > 2:
        batch = int(parts[2])
    return name, path, layers, batch


# ---------------------------------------------------------------------------- timing
# Clock cycles of torch.cuda._sleep that each timed step starts behind (--backward-tail-ms).
TAIL = {"cycles": 0}


def sleep_cycles_per_ms():
    """torch.cuda._sleep's cycles per ms on this GPU, timed by CUDA events."""
    import torch
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def timed(step, reps, warmup):
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if TAIL["cycles"]:
            torch.cuda._sleep(TAIL["cycles"])  # backward's last kernels, still running
        step()
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return t[len(t) // 2]


def warm_until_steady(step, label, min_steps=3, max_steps=12, tol=0.03):
    """The peer's warm-up: its first step compiles (torch.compile, CuTe DSL JIT, CUDA graph
    capture), so step until two consecutive steps agree within tol. Returns (first step s,
    warm-up s in all, steps)."""
    import torch
    times = []
    t_all = time.perf_counter()
    for k in range(max_steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"  {label} warm-up step {k + 1}: {times[-1]:.3f} s", flush=True)
        if k + 1 >= min_steps and abs(times[-1] - times[-2]) <= tol * times[-2]:
            break
    return times[0], time.perf_counter() - t_all, len(times)


def fresh(shapes, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [0.02 * torch.randn(s, device="cuda", generator=g) for s in shapes]
    grads = [1e-3 * torch.randn(s, device="cuda", generator=g) for s in shapes]
    return params, grads


def free():
    import gc
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def torch_muon(shapes):
    """torch.optim.Muon over fresh params with their grads set."""
    import torch
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    return torch.optim.Muon(ps, adjust_lr_fn="original", **SETTINGS)


def bench_torch(shapes, reps, warmup):
    opt = torch_muon(shapes)
    med = timed(opt.step, reps, warmup)
    del opt
    free()
    return med


def original_scale(lr, shape):
    """torch.optim.Muon's adjust_lr_fn="original" as the peer's adjust_lr callable."""
    return lr * math.sqrt(max(1.0, shape[-2] / shape[-1]))


class Peer:
    """gram-newton-schulz 0.1.6's Muon, variants a (torch's coefficients) and b (its
    defaults), on one set of params and grads (each variant its own momentum). The NS
    objects (compiled closures) of the first set are kept for the later ones."""
    ns_objects: dict = {}
    restarts: dict = {}

    def __init__(self, shapes, variant, ps, peer_restarts=None):
        from gram_newton_schulz import Muon as PeerMuon
        kw = dict(lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"],
                  momentum=SETTINGS["momentum"], nesterov=SETTINGS["nesterov"],
                  adjust_lr=original_scale, ns_epsilon=SETTINGS["eps"])
        if variant == "a":
            kw["ns_coefficients"] = [list(TORCH_COEFFICIENTS)] * SETTINGS["ns_steps"]
            if peer_restarts is not None:
                kw["gram_newton_schulz_restart_iterations"] = peer_restarts
        if variant in Peer.restarts:  # tuned once; the same answer every time
            kw["gram_newton_schulz_restart_iterations"] = Peer.restarts[variant]
        self.opt = PeerMuon(ps, **kw)
        Peer.restarts[variant] = list(self.opt.gram_newton_schulz_reset_iterations)
        if variant in Peer.ns_objects:
            self.opt.newton_schulz = Peer.ns_objects[variant]
        else:
            Peer.ns_objects[variant] = self.opt.newton_schulz
        self.coefficients = self.opt.ns_coefficients


def bench_peer(peer: Peer, reps, warmup, label):
    first, warm_s, n = warm_until_steady(peer.opt.step, label)
    med = timed(peer.opt.step, reps, warmup)
    return med, first, warm_s, n


def inprocess_flags(algorithm, restarts, gram_dtype, min_aspect):
    f = [f"--ns_algorithm={algorithm}"]
    if algorithm == "gram":
        if restarts is not None:
            f.append("--gram_restarts=" + (",".join(map(str, restarts)) or "none"))
        f.append(f"--gram_dtype={gram_dtype}")
        if min_aspect is not None:
            f.append(f"--gram_min_aspect_ratio={min_aspect}")
    return f


def step_bench(args, env=None):
    """step_bench run to completion (its stdout and stderr). A failed run raises with the
    end of its stderr (not the command line, which names every shape)."""
    from daemon_harness import _binary
    run = subprocess.run([_binary("bench/gpu/step_bench")] + args, capture_output=True,
                         text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"step_bench exit {run.returncode}: {run.stderr[-1500:]}")
    return run


def inprocess_run(shapes, reps, warmup, ns_batch_size, syrk, algorithm, o, env=None,
                  double_buffer=False):
    """step_bench --engine on the shapes, with the column's NS flags."""
    arg = ",".join(f"{r}x{c}" for r, c in shapes)
    return step_bench([f"--shapes={arg}", "--precision=medium", f"--reps={reps}",
                       f"--warmup={warmup}", f"--ns_batch_size={ns_batch_size}", "--engine"]
                      + (["--use_syrk"] if syrk and algorithm == "standard" else [])
                      + (["--double_buffer_momentum"] if double_buffer else [])
                      + inprocess_flags(algorithm, o.gram_restarts, o.gram_dtype,
                                        o.gram_min_aspect)
                      + [f"--sym_gemm_schedule={o.sym_gemm_schedule}"], env=env)


def bench_inprocess(shapes, reps, warmup, ns_batch_size, syrk, algorithm, o,
                    double_buffer=False):
    out = inprocess_run(shapes, reps, warmup, ns_batch_size, syrk, algorithm, o,
                        double_buffer=double_buffer).stdout
    return float(re.search(r"step_ms_median (\S+)", out).group(1))


# ---------------------------------------------------------------------------- kernel profiles
def kernel_profiler_library():
    """bench/gpu/kernel_profile.cc's library: the bundle's lib/ beside MUOND_BIN, or
    bazel-bin's."""
    bin_dir = os.environ.get("MUOND_BIN", os.path.join(ROOT, "bazel-bin"))
    for path in (os.path.join(bin_dir, "..", "lib", "libkernel_profile.so"),
                 os.path.join(bin_dir, "bench", "gpu", "libkernel_profile.so")):
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(f"libkernel_profile.so: not beside {bin_dir} (deploy/bundle.sh "
                            "puts it in the bundle's lib/; or `bazel build -c opt "
                            "//bench/gpu:step_bench //bench/gpu:libkernel_profile.so`)")


def cupti_library_path():
    """LD_LIBRARY_PATH with the folder of torch's libcupti.so.13 (its nvidia wheel) after
    the current one, for hosts whose CUDA toolkit has no CUPTI."""
    import glob
    current = os.environ.get("LD_LIBRARY_PATH", "")
    try:
        import nvidia
    except ImportError:
        return current
    found = sorted({os.path.dirname(f) for p in nvidia.__path__
                    for f in glob.glob(os.path.join(p, "*", "lib", "libcupti.so.13"))})
    return ":".join([d for d in [current] + found if d])


def profile_inprocess(path, shapes, reps, warmup, ns_batch_size, syrk, algorithm, o,
                      double_buffer=False):
    """One more in-process run under the CUPTI profiler (its timed steps only: step_bench
    brackets them with cudaProfilerStart/Stop); the profile's table goes to path."""
    if os.path.exists(path):
        os.remove(path)
    env = dict(os.environ, CUDA_INJECTION64_PATH=kernel_profiler_library(),
               MUOND_KERNEL_PROFILE=path, LD_LIBRARY_PATH=cupti_library_path())
    err = inprocess_run(shapes, reps, warmup, ns_batch_size, syrk, algorithm, o,
                        env=env, double_buffer=double_buffer).stderr
    if not os.path.isfile(path):  # the library did not load, or CUPTI refused
        said = [line for line in err.splitlines() if "kernel_profile" in line]
        raise RuntimeError(f"no kernel profile written to {path}; the library said: "
                           f"{' | '.join(said)[:600] or 'nothing'}; step_bench's stderr ends: "
                           f"{err[-600:]}")
    with open(path) as f:
        table = f.read()
    with open(path, "w") as f:  # the library cannot know what a step is
        f.write(f"step_bench --engine: totals over its {reps} timed steps\n" + table)


def short_kernel_name(name):
    """bench/gpu/kernel_name.h's ShortKernelName: a leading "void " dropped, "(anonymous
    namespace)" as "{anon}", the parameter list dropped, template arguments kept one level
    deep (deeper ones as <...>), trailing spaces dropped, at most 160 characters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)", "{anon}")
    out, depth = [], 0
    for ch in name:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
            if depth == 2:
                out.append("<...>")
        if depth <= 1:
            out.append(ch)
        if ch == ">" and depth > 0:
            depth -= 1
    return "".join(out).rstrip(" ")[:160] or name[:160]


def profile_torch_step(path, step, reps, warmup):
    """torch.profiler (CUPTI) over reps steps after warmup; the same table as the CUPTI
    library's, per kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
            name = e.name  # copies named as the CUPTI library names them
            if name.startswith("Memcpy"):  # "Memcpy DtoD (Device -> Device)"
                kind = (name.split() + ["other"])[1]
                name = f"[memcpy {kind if kind in ('HtoD', 'DtoH', 'DtoD') else 'other'}]"
            elif name.startswith("Memset"):
                name = "[memset]"
            r = rows.setdefault(short_kernel_name(name), [0, 0.0])
            r[0] += 1
            r[1] += e.device_time / 1e3
    total = sum(r[1] for r in rows.values())
    lines = [f"GPU activity: {sum(r[0] for r in rows.values())} records over {reps} steps "
             f"(torch.profiler); host wall {wall_ms:.3f} ms, GPU time {total:.3f} ms", "",
             "| kernel | launches | total ms | mean us | share |", "|---|---|---|---|---|"]
    for name, (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n} | {ms:.3f} | {1e3 * ms / n:.2f} | "
                     f"{100 * ms / total if total else 0:.1f}% |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def profile_set(a, o, name, shapes, cols, ns_batch, peers):
    """--kernel-profile: one profiled run per torch, peer and in-process column after the
    timed rounds (the profiler's own cost stays out of the table), each to
    <dir>/<set>_<column>.md. The daemon columns are not profiled here: their GPU work is
    the in-process column's engine (the daemon alone: bench/README.md)."""
    os.makedirs(a.kernel_profile, exist_ok=True)
    for c in cols:
        path = os.path.join(a.kernel_profile, f"{name}_{c}.md")
        if c.startswith("inproc_"):
            guarded(c + " profile", profile_inprocess, path, shapes, a.reps, a.warmup,
                    ns_batch, a.syrk, "standard" if c.endswith("std") else "gram", o,
                    double_buffer=c.endswith("_double_buffered"))
        elif c.startswith("peer_") and peers.get(c) is not None:
            guarded(c + " profile", profile_torch_step, path, peers[c].opt.step, a.reps,
                    a.warmup)
        elif c == "torch":
            opt = torch_muon(shapes)
            guarded(c + " profile", profile_torch_step, path, opt.step, a.reps, a.warmup)
            del opt
            free()


def muond_gram_kwargs(algorithm, o):
    if algorithm == "standard":  # the client's default is auto (Gram by shape)
        return dict(ns_algorithm="standard")
    kw = dict(ns_algorithm="gram")  # options only when set: the client's defaults otherwise
    if o.gram_dtype != "fp16":
        kw["gram_dtype"] = o.gram_dtype
    if o.gram_restarts is not None:
        kw["gram_restarts"] = list(o.gram_restarts)
    if o.gram_min_aspect is not None:
        kw["gram_min_aspect_ratio"] = o.gram_min_aspect
    return kw


def bench_daemon(shapes, reps, warmup, job, log_dir, ns_batch_size, syrk, algorithm, o,
                 step_channel=True, overlap_checks=True, poll_ms=None, double_buffer=False,
                 daemon_poll_ms=None):
    import torch
    from daemon_harness import Daemon
    from muond.torch import Muon
    params, grads = fresh(shapes, 0)
    ps = [torch.nn.Parameter(p) for p in params]
    with Daemon(job, log_dir=log_dir,
                daemon_args=(f"--sym_gemm_schedule={o.sym_gemm_schedule}",) + (
                    () if daemon_poll_ms is None
                    else (f"--step_channel_request_poll_ms={daemon_poll_ms:g}",))) as d:
        opt = Muon([{"params": ps, "param_names": [f"p{i}" for i in range(len(ps))]}],
                   daemons=[d.address], job_id=job, coefficient_type="simple",
                   scale_mode="original", extra_scale_factor=1.0, fp32_matmul_prec="medium",
                   ns_batch_size=ns_batch_size, use_syrk=syrk and algorithm == "standard",
                   step_channel=step_channel, overlap_checks=overlap_checks,
                   **({} if poll_ms is None else {"step_channel_poll_ms": poll_ms}),
                   double_buffer_momentum=double_buffer,
                   **muond_gram_kwargs(algorithm, o), **SETTINGS)
        try:
            opt.zero_grad(set_to_none=False)  # .grad = the shared buffers (zero-copy)
            for p, g in zip(ps, grads):
                p.grad.copy_(g)
            daemon_ms, parts = [], []

            def step():
                t0 = time.perf_counter()
                opt.step()
                wall = (time.perf_counter() - t0) * 1e6
                daemon_ms.append(opt.last_timings["total_us"] / 1e3)
                parts.append(dict(opt.last_timings, wall_us=wall))

            med = timed(step, reps, warmup)
            dm = sorted(daemon_ms[warmup:])
            print_breakdown(algorithm + ("" if step_channel else ", Step RPC")
                            + ("" if overlap_checks else ", checks first")
                            + ("" if poll_ms is None else ", neither end polling")
                            + (", double-buffered momentum" if double_buffer else ""),
                            parts[warmup:])
        finally:
            opt.close()
    del ps, params, grads
    free()
    return med, dm[len(dm) // 2]


def print_breakdown(label, parts):
    """Where a daemon step's time goes (medians, ms): the client's Python
    (wall - rpc: grad re-pointing, device sync, overrides), gRPC + server
    (rpc - daemon total) and of it the daemon's Step handler around the
    engine (handler - total: locks, checks, plan, record), the daemon's
    phases, and the daemon total not in a phase (the non-finite check and its
    sync, shape timing, bookkeeping)."""
    def med(key):
        v = sorted(p[key] for p in parts)
        return v[len(v) // 2] / 1e3
    phases = ["momentum_us", "a2a_fwd_us", "ns_us", "a2a_bwd_us", "update_us"]
    outside = sorted((p["total_us"] - sum(p[k] for k in phases)) for p in parts)
    print("daemon %s breakdown (median ms): wall %.2f = client %.2f + rpc %.2f; rpc = "
          "grpc/server %.2f (of it the handler around the engine %.2f) + daemon %.2f; "
          "daemon = %s + outside phases %.2f" % (
              label, med("wall_us"), med("wall_us") - med("rpc_us"), med("rpc_us"),
              med("overhead_us"), med("handler_us") - med("total_us"), med("total_us"),
              " + ".join("%s %.2f" % (k[:-3], med(k)) for k in phases),
              outside[len(outside) // 2] / 1e3), flush=True)
    if all("request_leg_us" in p for p in parts):  # through the step channel
        print("daemon %s round trip beyond the handler (median ms): request leg %.3f (the "
              "trainer writes its request -> the daemon has parsed it), answer leg %.3f (the "
              "daemon encodes its answer -> the trainer has parsed it)"
              % (label, med("request_leg_us"), med("answer_leg_us")), flush=True)


def bench_rpc(reps, job, log_dir):
    import torch
    from daemon_harness import Daemon
    from muond.torch import Muon
    p = torch.nn.Parameter(torch.randn(8, 8, device="cuda"))
    with Daemon(job, log_dir=log_dir) as d:
        opt = Muon([p], daemons=[d.address], job_id=job, coefficient_type="simple",
                   scale_mode="original", **SETTINGS)
        try:
            us = []
            for i in range(reps + 20):
                opt.step()
                if i >= 20:
                    us.append(opt.last_timings["rpc_us"])
        finally:
            opt.close()
    us.sort()
    return us[len(us) // 2], us[int(0.99 * (len(us) - 1))]


class GpuClocks:
    """--gpu-clocks: nvidia-smi's utilization, SM clock and power draw of one GPU, sampled
    every 100 ms while a column runs (a `with` block); medians() keeps the samples with the
    GPU busy (utilization >= BUSY_PERCENT), so that a column's set-up and idle gaps do not
    count. Off (enabled False) or without nvidia-smi: no samples, medians() None."""
    BUSY_PERCENT = 80

    def __init__(self, enabled: bool, gpu: str | None = None):
        self.enabled, self.gpu, self.proc, self.samples = enabled, gpu, None, []

    def __enter__(self):
        if self.enabled:
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm,power.draw",
                   "--format=csv,noheader,nounits", "-lms", "100"]
            if self.gpu is not None:
                cmd += ["-i", self.gpu]
            try:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                out = self.proc.communicate(timeout=5)[0]
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out = self.proc.communicate()[0]
            self.samples = self.parse(out)
        return False

    @staticmethod
    def parse(text: str) -> list[tuple[float, float, float]]:
        """(utilization %, SM MHz, W) per line of nvidia-smi's csv; unreadable lines
        (a '[N/A]', a line cut by the kill) are skipped."""
        samples = []
        for line in text.splitlines():
            try:
                util, mhz, watts = (float(v) for v in line.split(","))
            except ValueError:
                continue
            samples.append((util, mhz, watts))
        return samples

    def medians(self) -> tuple[float, float, int] | None:
        """(SM MHz, W, samples) medians over the busy samples, or None."""
        busy = [s for s in self.samples if s[0] >= self.BUSY_PERCENT]
        if not busy:
            return None
        mid = len(busy) // 2
        return (sorted(s[1] for s in busy)[mid], sorted(s[2] for s in busy)[mid], len(busy))


def gpu_for_clocks():
    """nvidia-smi's id of the GPU the bench runs on (torch's cuda:0, by PCI bus id); None
    (nvidia-smi then samples every GPU) where torch does not say."""
    import torch
    try:
        p = torch.cuda.get_device_properties(0)
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except (AttributeError, RuntimeError, AssertionError) as e:
        print(f"--gpu-clocks: every GPU sampled ({e})", flush=True)
        return None


def guarded(label, fn, *args, **kwargs):
    """One column; a contender that cannot run here (peer not installed, muond option not
    there yet) is reported, not fatal."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001: any failure is one missing cell
        print(f"{label}: not measured: {type(e).__name__}: {str(e)[-1600:]}", flush=True)
        return None


# ---------------------------------------------------------------------------- one set
def run_set(name, manifest, layers, ns_batch, a, o):
    import torch
    shapes = shape_set(manifest, layers)
    cols = [c for c in COLUMNS if c in a.columns]
    rows = []  # per round: {column: ms}, daemon-side ms under "<col>_side"
    peer_info = {}
    peers = {}
    peer_ps = None
    if any(c.startswith("peer_") for c in cols):
        params, grads = fresh(shapes, 0)
        peer_ps = [torch.nn.Parameter(p) for p in params]
        for p, g in zip(peer_ps, grads):
            p.grad = g
        for c in cols:
            if c.startswith("peer_"):
                t0 = time.perf_counter()
                peers[c] = guarded(c, Peer, shapes, c[-1], peer_ps, a.peer_restarts)
                peer_info[c] = dict(construct_s=time.perf_counter() - t0,
                                    kernels=getattr(getattr(peers[c], "opt", None),
                                                    "ns_use_kernels", None))
    gpu = gpu_for_clocks() if a.gpu_clocks else None
    for r in range(a.rounds):
        row = {}
        for c in cols:
            with GpuClocks(a.gpu_clocks, gpu) as clocks:
                run_column(c, row, name, r, shapes, ns_batch, peers, peer_info, a, o)
            row[c + "_clocks"] = clocks.medians()
        rows.append(row)
        print(f"{name} round {r + 1}: " + ", ".join(
            f"{c} {row[c]:.2f}" for c in cols if row.get(c) is not None), flush=True)
    if a.kernel_profile:
        profile_set(a, o, name, shapes, cols, ns_batch, peers)
    for p in peers.values():
        if p is not None:
            p.opt.state.clear()
    del peers, peer_ps
    free()
    return shapes, cols, rows, peer_info


def run_column(c, row, name, r, shapes, ns_batch, peers, peer_info, a, o):
    """Column ``c`` of round ``r``: its ms into ``row`` (and the daemon's own ms)."""
    if c == "torch":
        row[c] = guarded(c, bench_torch, shapes, a.reps, a.warmup)
    elif c.startswith("peer_"):
        if peers.get(c) is None:
            return
        res = guarded(c, bench_peer, peers[c], a.reps, a.warmup, f"{name} {c}")
        if res:
            row[c] = res[0]
            peer_info[c].setdefault("first", []).append(res[1:])
    elif c.startswith("inproc_"):
        row[c] = guarded(c, bench_inprocess, shapes, a.reps, a.warmup, ns_batch,
                         a.syrk, "standard" if c.endswith("std") else "gram", o,
                         double_buffer=c.endswith("_double_buffered"))
    else:
        res = guarded(c, bench_daemon, shapes, a.reps, a.warmup, f"{name}{r}{c}",
                      a.log_dir, ns_batch, a.syrk,
                      "standard" if c.endswith("std") else "gram", o,
                      step_channel=not c.endswith("_grpc"),
                      overlap_checks=not c.endswith("_checks_first"),
                      poll_ms=0.0 if c.endswith("_asleep") else None,
                      daemon_poll_ms=0.0 if c.endswith("_asleep") else None,
                      double_buffer=c.endswith("_double_buffered"))
        if res:
            row[c], row[c + "_side"] = res


def fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def ratio(x, y):
    return None if x is None or y is None else x / y


def set_table(name, layers, ns_batch, shapes, cols, rows, peer_info, a, o):
    model = json.load(open(os.path.join(ROOT, "bench/manifests", name + ".json")))["model"] \
        if os.path.exists(os.path.join(ROOT, "bench/manifests", name + ".json")) else name
    std = sum(standard_ns_flops(s) for s in shapes)
    lines = [f"### {model}, first {layers} layers: {len(shapes)} matrices, "
             f"{std / 1e12:.2f} TFLOP of standard NS per step; muond ns_batch_size "
             f"{ns_batch or '0 (auto)'}"
             f"{', use_syrk' if a.syrk else ''}", ""]
    head = ["round"] + [TITLES[c] + " ms" for c in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, row in enumerate(rows):
        cells = [str(k + 1)]
        for c in cols:
            v = fmt(row.get(c))
            if c.startswith("daemon_") and row.get(c + "_side") is not None:
                v += f" ({row[c + '_side']:.2f})"
            cells.append(v)
        lines.append("| " + " | ".join(cells) + " |")
    goal = GOALS.get(name)
    muond = any(c.startswith(("daemon_", "inproc_")) for c in cols)
    if muond:
        lines += ["", "(daemon columns: wall ms per step (daemon-side ms).)", "",
                  "| round | muond gram daemon: vs peer (a) | vs peer (b) | vs torch | "
                  "daemon / in-process std | daemon / in-process gram | "
                  "daemon over the Step RPC / in-process gram | "
                  "daemon, checks first / in-process gram | "
                  "daemon, neither end polling / in-process gram | "
                  "daemon / in-process, both double-buffered |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    for k, row in enumerate(rows if muond else []):
        d = row.get("daemon_gram")
        cells = [ratio(row.get("peer_a"), d), ratio(row.get("peer_b"), d),
                 ratio(row.get("torch"), d)]
        txt = []
        for j, v in enumerate(cells):
            s = "n/a" if v is None else f"{v:.3f}x"
            if goal and goal[j] is not None and v is not None:
                s += f" ({'met' if v >= goal[j] else 'missed'}: goal {goal[j]}x)"
            txt.append(s)
        over = ratio(row.get("daemon_gram"), row.get("inproc_gram"))
        txt += [fmt(ratio(row.get("daemon_std"), row.get("inproc_std")), ".3f"),
                fmt(over, ".3f") + ("" if over is None else
                                    f" ({'met' if over <= DAEMON_OVER_INPROCESS_GOAL else 'missed'}"
                                    f": goal <= {DAEMON_OVER_INPROCESS_GOAL})"),
                fmt(ratio(row.get("daemon_gram_grpc"), row.get("inproc_gram")), ".3f"),
                fmt(ratio(row.get("daemon_gram_checks_first"), row.get("inproc_gram")), ".3f"),
                fmt(ratio(row.get("daemon_gram_asleep"), row.get("inproc_gram")), ".3f"),
                fmt(ratio(row.get("daemon_gram_double_buffered"),
                          row.get("inproc_gram_double_buffered")), ".3f")]
        lines.append(f"| {k + 1} | " + " | ".join(txt) + " |")
    # Efficiency: the median over rounds of each column.
    lines += ["", "| column | ms (rounds) | effective NS TFLOP/s | NS the column runs | "
              "its ideal TFLOP | fraction of 989 TFLOP/s |", "|---|---|---|---|---|---|"]
    for c in cols:
        ms = [row[c] for row in rows if row.get(c) is not None]
        if not ms:
            continue
        t = sorted(ms)[len(ms) // 2] / 1e3
        algo, restarts, aspect = column_algorithm(c, o)
        ideal = sum(ideal_ns_flops(s, algo, restarts, min_aspect=aspect) for s in shapes)
        what = algo if algo == "standard" else f"gram, restarts {list(restarts)}" + \
            (f", aspect >= {aspect:g}" if aspect is not None and aspect > 1 else
             ", aspect >= muond's size-aware default" if aspect is None else "")
        lines.append(f"| {TITLES[c]} | {' / '.join(f'{v:.2f}' for v in ms)} | "
                     f"{std / t / 1e12:.0f} | {what} | {ideal / 1e12:.2f} | "
                     f"{ideal / t / H200_DENSE_PEAK:.3f} |")
    if a.gpu_clocks:
        lines += ["", "| round | column | median SM MHz, GPU busy | median W | busy samples |",
                  "|---|---|---|---|---|"]
        for k, row in enumerate(rows):
            for c in cols:
                m = row.get(c + "_clocks")
                if m is not None:
                    lines.append(f"| {k + 1} | {TITLES[c]} | {m[0]:.0f} | {m[1]:.0f} | {m[2]} |")
    for c, info in peer_info.items():
        firsts = info.get("first", [])
        lines.append("")
        lines.append(f"{TITLES[c]}: restarts {Peer.restarts.get(c[-1])}, CuTe DSL kernels "
                     f"{info.get('kernels')}; constructor "
                     f"{info['construct_s']:.1f} s; first step / warm-up in all / steps: " +
                     "; ".join(f"{f:.1f} s / {w:.1f} s / {n}" for f, w, n in firsts))
    return "\n".join(lines)


def column_algorithm(c, o):
    """(algorithm, restarts, min aspect) the column's NS runs, for the FLOP model."""
    if c == "torch" or c.endswith("_std"):
        return "standard", (), 1.0
    if c.startswith("peer_"):
        return "gram", Peer.restarts.get(c[-1], [2]), 1.0
    restarts = o.gram_restarts if o.gram_restarts is not None else o.muond_default_restarts
    if o.gram_min_aspect is None:
        return "gram", restarts, None  # muond's size-aware default, per shape
    return "gram", restarts, max(o.gram_min_aspect, 1.0)


# ---------------------------------------------------------------------------- sweep
SWEEP_N = (1024, 2048, 4096)
SWEEP_RATIOS = (1.0, 1.25, 1.5, 2.0, 3.5)
SWEEP_BATCH = {1024: 16, 2048: 4, 4096: 2}


def sweep_aspect(a, o):
    """muond's NS alone (step_bench --ns_only), standard vs Gram (forced on every shape:
    --gram_min_aspect_ratio=1), n x m wide matrices, SWEEP_BATCH[n] per batched NS."""
    results = {}
    for n in SWEEP_N:
        shapes = [(n, int(round(r * n))) for r in SWEEP_RATIOS]
        b = SWEEP_BATCH[n]
        arg = ",".join(f"{r}x{c}" for r, c in shapes for _ in range(b))
        for algo in ("standard", "gram"):
            flags = inprocess_flags(algo, o.gram_restarts, o.gram_dtype, 1.0)
            out = step_bench([f"--shapes={arg}", "--precision=medium", f"--reps={a.reps}",
                              f"--warmup={a.warmup}", f"--ns_batch_size={b}", "--ns_only"]
                             + (["--use_syrk"] if a.syrk and algo == "standard" else [])
                             + flags).stdout
            for m in re.finditer(r"ns_ms (\d+)x(\d+) batch (\d+) median (\S+)", out):
                results[(int(m.group(1)), int(m.group(2)), algo)] = float(m.group(4)) / b
    lines = ["| n | m/n | m | standard NS ms | gram NS ms | standard / gram |",
             "|---|---|---|---|---|---|"]
    crossover = []
    for n in SWEEP_N:
        pays = []
        for r in SWEEP_RATIOS:
            m = int(round(r * n))
            s, g = results.get((n, m, "standard")), results.get((n, m, "gram"))
            q = ratio(s, g)
            pays.append(q is not None and q > 1.0)
            lines.append(f"| {n} | {r:g} | {m} | {fmt(s, '.3f')} | {fmt(g, '.3f')} | "
                         f"{fmt(q, '.3f')} |")
        # The smallest m/n from which Gram is faster at every larger ratio measured.
        first = next((SWEEP_RATIOS[i] for i in range(len(pays)) if all(pays[i:])), None)
        crossover.append(f"n = {n}: " + (f"gram pays from m/n >= {first:g}" if first
                                         else "gram never pays"))
    lines += ["", "Crossover (ms per matrix, batches of "
              + ", ".join(f"{b} at n = {n}" for n, b in SWEEP_BATCH.items()) + "): "
              + "; ".join(crossover) + "."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=None, metavar="NAME[:LAYERS[:BATCH]]",
                    help="a manifest name (bench/manifests) or .json path, its layers and "
                         "muond's ns_batch_size; repeat for several sets in one process "
                         f"(defaults {SET_DEFAULTS})")
    ap.add_argument("--manifest", default=None, help="one set (older form of --set)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--ns-batch-size", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2,
                    help="every column measured this many times, interleaved")
    ap.add_argument("--columns", default=",".join(
        c for c in COLUMNS if c not in OPT_IN_COLUMNS),
                    help="comma list of " + ", ".join(COLUMNS) + " (default: all but "
                    + ", ".join(OPT_IN_COLUMNS) + ")")
    ap.add_argument("--syrk", action="store_true",
                    help="muond's standard NS columns run use_syrk")
    ap.add_argument("--gram-restarts", default=None,
                    help="muond gram restarts, e.g. 2 or 2,4 or none (default: muond's)")
    ap.add_argument("--muond-default-restarts", default=None,
                    help="display only: the restarts the FLOP model assumes for muond when "
                         "--gram-restarts is not given (default: read from "
                         "core/muon/coefficients.cc, simple x 5 in --gram-dtype; [3]); "
                         "muond itself always runs its own default")
    ap.add_argument("--gram-dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--gram-min-aspect", type=float, default=None,
                    help="muond gram_min_aspect_ratio, one number for all sizes (default: "
                         "muond's measured size-aware default, 2.5 below a short side of "
                         "1536, 1.5 from it)")
    ap.add_argument("--peer-restarts", default=None,
                    help="peer (a)'s restarts, e.g. 2 (default: its tuner's pick)")
    ap.add_argument("--sym-gemm-schedule", default="auto",
                    choices=["auto", "cooperative", "pingpong", "wide"],
                    help="the symmetric GEMM kernel's schedule, in-process and daemon "
                         "(step_bench's and muond-daemon's --sym_gemm_schedule)")
    ap.add_argument("--sweep-aspect", action="store_true",
                    help="instead: muond standard vs gram NS over n x m, n in "
                         f"{SWEEP_N}, m/n in {SWEEP_RATIOS}")
    ap.add_argument("--kernel-profile", default=None, metavar="DIR",
                    help="after each set's rounds, one more run per torch, peer and "
                         "in-process column (not the daemon's: the same engine) under a "
                         "CUPTI profiler (torch.profiler; "
                         "bench/gpu/kernel_profile.cc for step_bench): per-kernel GPU time "
                         "in DIR/<set>_<column>.md")
    ap.add_argument("--gpu-clocks", action="store_true",
                    help="per round and column, the GPU's median SM clock and power draw "
                         "while busy (nvidia-smi every 100 ms), in a table after the set's")
    ap.add_argument("--backward-tail-ms", type=float, default=0.0,
                    help="each timed step of the torch, peer and daemon columns starts "
                         "behind this much GPU work (a stand-in for backward's tail)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the no-work Step RPC probe")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None, help="also write the markdown here")
    a = ap.parse_args()

    def restarts(text):
        if text is None:
            return None
        return [] if text == "none" else [int(x) for x in text.split(",")]

    a.columns = set(a.columns.split(","))
    bad = a.columns - set(COLUMNS)
    if bad:
        ap.error(f"--columns: unknown {sorted(bad)}; known: {COLUMNS}")
    if a.kernel_profile and a.sweep_aspect:
        ap.error("--kernel-profile profiles the step columns, not --sweep-aspect")
    if a.kernel_profile and not any(c.startswith(("torch", "peer_", "inproc_"))
                                    for c in a.columns):
        ap.error("--kernel-profile profiles the torch, peer and in-process columns; "
                 "--columns has none of them (the daemon's engine is the in-process one)")
    if a.backward_tail_ms and (a.sweep_aspect or any(c.startswith("inproc_")
                                                     for c in a.columns)):
        ap.error("--backward-tail-ms: the in-process columns run in step_bench, which queues "
                 "no backward stand-in; leave them out (and --sweep-aspect)")
    a.peer_restarts = restarts(a.peer_restarts)
    o = argparse.Namespace(gram_restarts=restarts(a.gram_restarts), gram_dtype=a.gram_dtype,
                           gram_min_aspect=a.gram_min_aspect,
                           sym_gemm_schedule=a.sym_gemm_schedule,
                           muond_default_restarts=restarts(a.muond_default_restarts))
    if o.muond_default_restarts is None:
        o.muond_default_restarts = default_gram_restarts(a.gram_dtype)
    if o.muond_default_restarts is None:
        ap.error("--muond-default-restarts: simple x 5 not found in core/muon/coefficients.cc; "
                 "pass it")
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import torch
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):  # the peer compiles per shape: no eager fallback
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))

    if a.backward_tail_ms:
        TAIL["cycles"] = int(a.backward_tail_ms * sleep_cycles_per_ms())
    what = "NS runs" if a.sweep_aspect else "steps"
    rounds = "" if a.sweep_aspect else f", {a.rounds} rounds"
    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median of "
              f"{a.reps} {what} per cell{rounds}; command: "
              f"`python3 bench/gpu_step_bench.py {' '.join(sys.argv[1:])}`")
    if a.sweep_aspect:
        text = header + "\n\n" + sweep_aspect(a, o)
    else:
        if a.set:
            sets = [parse_set(s) for s in a.set]
        else:
            name, path, layers, batch = parse_set(a.manifest or "llama3_8b")
            sets = [(name, path, a.layers or layers, a.ns_batch_size or batch)]
        out = [header]
        for name, path, layers, batch in sets:
            shapes, cols, rows, peer_info = run_set(name, path, layers, batch, a, o)
            out.append(set_table(name, layers, batch, shapes, cols, rows, peer_info, a, o))
            print("\n" + out[-1], flush=True)
            if a.out:  # each set as soon as it is done: a call cut short keeps them
                with open(a.out, "w") as f:
                    f.write("\n\n".join(out) + "\n")
        if not a.no_rpc and any(c.startswith("daemon_") for c in a.columns):
            rpc = guarded("rpc", bench_rpc, 200, "benchrpc", a.log_dir)
            if rpc:
                out.append(f"Step RPC round trip, one 8x8 param (Unix socket): p50 "
                           f"{rpc[0]:.0f} us, p99 {rpc[1]:.0f} us")
        text = "\n\n".join(out)
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
