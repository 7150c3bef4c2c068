#!/usr/bin/env python3
"""The whole training step of a Llama-style model with muond vs torch.optim.Muon vs muonium.

    muond launch --device cuda --nproc-per-node 8 -- torchrun --standalone \\
        --nproc-per-node 8 bench/llama_train_bench.py --device cuda --model 1b \\
        --parallel fsdp --out out/llama

One torchrun job, one PyTorch layout (--parallel: ddp, fsdp, tp, fsdp+tp, hsdp,
as examples/char_gpt/train_dist.py builds them, whose helpers this imports), and
the optimizers of --optimizers one after another in the same processes; each
starts from the same seed-initialised model and sees the same random-token
batches, and the previous one's model and optimizer are freed (and the CUDA
cache emptied) before the next is built:

  muond    muond.torch.Muon as train_dist.build_optimizer builds it (block
           matrices -> Muon, embedding/norms/head -> its "adamw" group), the
           Newton-Schulz layer-sharded over the job's daemons (`muond launch`);
           NS precision --muond-ns-precision (default medium = bf16 operands,
           fp32 accumulation: the peers' precision)
  torch    torch.optim.Muon in every process: redundant NS. A DTensor param
           (FSDP2, TP, HSDP) gets a full-size plain replica on every rank; each
           step gathers the full gradient (full_tensor()), steps the replica and
           copies this rank's shard back (Replicate -> the param's placements:
           local). DDP params are plain: stepped directly. Non-matrix params:
           torch.optim.AdamW (DTensor-aware)
  muonium  PyPI muonium 0.2.0's Muon (DTensor/FSDP2-aware; --muonium-path DIR
           or the environment). Its NS always runs its Triton Gram kernel, which
           is CUDA only: skipped on CPU with a note

Same hyperparameters for all: Muon lr, momentum 0.95 with Nesterov, decoupled
weight decay, 5 NS steps with torch's coefficients (3.4445, -4.775, 2.0315) and
NS eps 1e-7 (torch's and muonium's default; muond's char-GPT examples use 1e-15),
torch's `original` lr scale sqrt(max(1, rows/cols)); AdamW lr/betas/eps/wd. Each
optimizer's Muon and AdamW group values, read back from the built optimizer,
are in the JSON (results.<name>.hyperparameters).

Timing: --warmup untimed steps, then --steps timed ones. Per step the wall time
of zero_grad + forward + backward and of opt.step() (each bracketed by
torch.cuda.synchronize() on cuda), max over ranks per step, median over steps;
each rank's own per-step times are in the JSON (results.<name>.ranks). With
--no-split-sync there is no synchronisation between backward and opt.step(), as
in a training loop (an optimizer may then send or launch its step while
backward's kernels still run): the step's time is as before, and the fwd+bwd
and opt step columns are the host's time until opt.step() is called and in it.

Correctness: with --compare-params (default) rank 0 compares every optimizer's
final params with torch's; --max-param-diff X turns muond's comparison into a
check: above X the table and JSON say MISMATCH and rank 0 exits 1 after writing
them (so torchrun and `muond launch` exit non-zero).

Output: a markdown table on rank 0's stdout, <out>/<parallel>-w<N>.json and .md
(<parallel>-i<inner>-w<N> for the 2-D layouts), rewritten after each optimizer
and on a failure, so a failed optimizer is named there beside what ran before.
bench/llama_train_report.py merges several JSONs into one table.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHAR_GPT = os.path.join(os.path.dirname(HERE), "examples", "char_gpt")
sys.path[:0] = [HERE, CHAR_GPT]

from llama.model import PRESETS, LlamaConfig  # noqa: E402
from llama_train_report import run_stem  # noqa: E402
from llama.optimizers import (RedundantTorchMuon, build_muond,  # noqa: E402
                              build_muonium, hyperparameters, import_muonium,
                              optimizer_notes)
from gpu_memory import GpuUsedPeak  # noqa: E402
from llama.run_report import OPTIMIZERS, ratios, write_outputs  # noqa: E402
from options import LAYOUTS, TWO_D, dp_size, tp_size  # noqa: E402  (char_gpt, no torch)

# Per data-parallel rank: (sequences, tokens per sequence). 1b: 4 x 2048 fits
# one H200 at world 1 with fp32 params, bf16 autocast and no activation
# checkpointing: measured trainer peaks 46 / 68 / 57 GiB with muond / torch
# (full replicas) / muonium (bench/results/gpu_h200_llama_train.md).
BATCH_DEFAULTS = {"1b": (4, 2048), "tiny": (4, 32)}


def at_least(low: int, why: str = ""):
    """An argparse type: an int >= low (the error names the option and, when
    given, why)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}{why}")
        return value
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # NaN included
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# At one token per sequence causal attention's softmax runs over a single key,
# so q and k get no gradient (the softmax's derivative is 0) and Muon would
# orthogonalize rounding noise: muond and torch then differ by 0.2-0.3 on q and k
# even with fp32 NS (fsdp, 2 ranks), a difference of noise, not of the optimizers.
SEQ_WHY = (" (with 1 token attention's softmax has one key, so q and k get no gradient and "
           "Muon orthogonalizes rounding noise)")


def optimizer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct names from {','.join(OPTIMIZERS)}, got {text!r}")
    return names


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None (those options' help says what applies)."""

    def _get_help_string(self, action):
        if action.default is None or (action.default is False and action.nargs == 0):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama_train_bench.py",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="1b",
                   help="1b: Llama-3.2-1B's shape (untied head; refused on CPU without "
                        "--allow-large-cpu); tiny: a CPU-sized one")
    p.add_argument("--layers", type=at_least(1), help="override the preset's layer count")
    p.add_argument("--heads", type=at_least(1), help="override the preset's attention heads")
    p.add_argument("--kv-heads", type=at_least(1),
                   help="override the preset's kv heads (GQA)")
    p.add_argument("--parallel", choices=LAYOUTS, default="fsdp", help="the layout")
    p.add_argument("--inner", type=at_least(1), default=2,
                   help="inner mesh dim of the 2-D layouts (fsdp+tp: TP size; hsdp: shard "
                        "group size)")
    p.add_argument("--optimizers", type=optimizer_list, default=",".join(OPTIMIZERS),
                   help="comma list, run in this order")
    p.add_argument("--batch", type=at_least(1),
                   help="sequences per data-parallel rank (default: 4 for 1b and tiny)")
    p.add_argument("--seq", type=at_least(2, SEQ_WHY),
                   help="tokens per sequence, >= 2 (default: 2048 for 1b, 32 for tiny)")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed steps")
    p.add_argument("--no-split-sync", action="store_true",
                   help="no synchronisation between backward and opt.step() (a training "
                        "loop's timing; fwd+bwd and opt step ms are then host times)")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed steps before them")
    p.add_argument("--lr", type=float, default=0.02, help="Muon lr")
    p.add_argument("--momentum", type=float, default=0.95, help="Muon momentum (Nesterov)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="Muon weight decay")
    p.add_argument("--ns-steps", type=at_least(1), default=5,
                   help="Newton-Schulz iterations (torch's coefficients), all optimizers")
    p.add_argument("--adamw-lr", type=float, default=3e-4,
                   help="lr of the non-matrix params (embedding, norms, head): AdamW")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("B1", "B2"),
                   help="AdamW betas")
    p.add_argument("--adamw-weight-decay", type=float, default=0.0,
                   help="AdamW's decoupled weight decay")
    p.add_argument("--muond-ns-precision", choices=["medium", "high", "highest"],
                   default="medium",
                   help="muond's fp32_matmul_prec: medium = bf16 NS as torch.optim.Muon "
                        "and muonium run it; highest = fp32; high = TF32 (cuda)")
    p.add_argument("--muond-state-dtype", choices=["auto", "fp32", "bf16", "fp8_e4m3"],
                   default="auto",
                   help="muond's optimizer state dtype (auto: the params' dtype, as torch)")
    p.add_argument("--muond-state-location", choices=["device", "host"], default="device",
                   help="where muond's daemon keeps the state (host: pinned host memory, "
                        "streamed under the NS)")
    p.add_argument("--muond-ns-batch-size", type=at_least(0), default=None, metavar="N",
                   help="muond's ns_batch_size: same-shape matrices orthogonalised N "
                        "at a time, 0 auto by shape (default: muond's own, auto)")
    p.add_argument("--torch-ns-precision", choices=["bf16", "fp32"], default="bf16",
                   help="torch.optim.Muon's NS: bf16 (its own) or fp32 (its one bf16 cast "
                        "swapped for an fp32 copy during its step; with --muond-ns-precision "
                        "highest the two then differ by fp32 rounding: the CI test's check)")
    p.add_argument("--muonium-path", metavar="DIR",
                   help="a directory holding the muonium package, put first on sys.path: "
                        "the unpacked wheel (`pip download --no-deps muonium==0.2.0 -d D` then "
                        "`python3 -m zipfile -e D/muonium-0.2.0-py3-none-any.whl D/x`; "
                        "DIR = D/x); without it muonium must be installed. A missing DIR "
                        "is refused when muonium is in --optimizers, on any device")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--allow-large-cpu", action="store_true",
                   help="run --model 1b on CPU anyway (tens of GB per rank, minutes a "
                        "step; --model tiny is the CPU model)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--wait-healthy", type=positive_float, default=60.0,
                   help="seconds muond's client waits for the daemons")
    p.add_argument("--threads", type=at_least(0), default=0,
                   help="torch CPU threads (0: 1 per rank with several ranks, else up to 4)")
    p.add_argument("--compare-params", action=argparse.BooleanOptionalAction, default=True,
                   help="gather the final params whole and compare each optimizer's with "
                        "torch's on rank 0 (1b: every rank gathers a ~6 GB host copy, rank 0 "
                        "keeps at most two; seconds)")
    p.add_argument("--max-param-diff", type=positive_float, metavar="X",
                   help="fail (exit 1, MISMATCH in the table and JSON) when muond's final "
                        "params differ from torch's by more than X (max over tensors of "
                        "||muond - torch|| / ||torch||); needs muond, torch and "
                        "--compare-params. bench/README.md: 1e-3 with fp32 NS on both "
                        "sides, 0.2 with bf16")
    p.add_argument("--out", default="out/llama_bench", help="directory for the JSON and .md")
    return p


def model_config(args) -> LlamaConfig:
    cfg = PRESETS[args.model]
    over = {k: v for k, v in (("layers", args.layers), ("heads", args.heads),
                              ("kv_heads", args.kv_heads)) if v is not None}
    return LlamaConfig(**{**cfg.__dict__, **over})


def layout_problem(args, cfg: LlamaConfig, world: int) -> str:
    """The broken rule naming the options that fix it; '' when the layout fits."""
    # Signs and sizes of single options: their argparse types (at_least).
    if args.max_param_diff is not None and not (
            args.compare_params and {"muond", "torch"} <= set(args.optimizers)):
        return (f"--max-param-diff {args.max_param_diff} checks muond's final params against "
                "torch's: it needs muond and torch in --optimizers and --compare-params")
    if args.parallel in TWO_D and world % args.inner:
        return (f"--parallel {args.parallel} lays the {world} processes out as a "
                f"(N / {args.inner}) x {args.inner} mesh (--inner {args.inner}): torchrun "
                f"--nproc-per-node must be a multiple of --inner")
    if cfg.heads % cfg.kv_heads or cfg.d_model % cfg.heads or cfg.head_dim % 2:
        return (f"--model {args.model}: --heads {cfg.heads} must divide d_model "
                f"{cfg.d_model} into even head widths and be a multiple of --kv-heads "
                f"{cfg.kv_heads}")
    tp = tp_size(args, world)
    if tp > 1 and cfg.kv_heads % tp:
        inner = "--inner" if args.parallel == "fsdp+tp" else "torchrun --nproc-per-node"
        return (f"--parallel {args.parallel}: the {cfg.kv_heads} kv heads of --model "
                f"{args.model} (--kv-heads) are not divisible by the TP size {tp} "
                f"(ColwiseParallel splits k/v by head); pass --kv-heads a multiple of {tp}, "
                f"a TP size dividing {cfg.kv_heads} ({inner}), or --parallel fsdp, hsdp or ddp")
    return ""


def resolve_device(args) -> str:
    """--device auto -> cuda when torch sees a GPU, else cpu."""
    if args.device != "auto":
        return args.device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_environment(args) -> str:
    """What keeps the run from starting (before any process group): '' if nothing.
    args.device is resolved (not auto)."""
    if args.muonium_path and not os.path.isdir(args.muonium_path):
        # Checked on every device (on CPU muonium is skipped, so a typo would
        # surface only on the GPU machine). Unused without muonium: a wrapper
        # (bench/gpu_multigpu_jobs.sh) may pass it whether or not the wheel came along.
        if "muonium" in args.optimizers:
            return (f"--muonium-path {args.muonium_path}: no such directory (the unpacked "
                    "muonium wheel: bench/README.md), or drop muonium from --optimizers")
        print(f"llama_train_bench.py: note: --muonium-path {args.muonium_path} does not "
              "exist; unused (muonium not in --optimizers)", file=sys.stderr)
    if args.device == "cpu" and args.model == "1b" and not args.allow_large_cpu:
        return ("--model 1b on CPU (1.5B params: tens of GB and minutes per step per rank): "
                "pass --model tiny (the CPU model), --device cuda on a GPU host, or "
                "--allow-large-cpu to run it anyway")
    if "muond" in args.optimizers and not os.environ.get("MUOND_JOB_ID"):
        return ("--optimizers has muond but MUOND_JOB_ID is not set: run under `muond launch "
                "[--device cuda] -- torchrun ...`, or drop muond from --optimizers")
    if "muonium" in args.optimizers and args.device == "cuda":
        try:
            import_muonium(args)
        except ImportError as e:
            return (f"--optimizers has muonium but it does not import ({e}): pass "
                    "--muonium-path DIR (the unpacked muonium-0.2.0 wheel) or install it, or "
                    "drop muonium from --optimizers")
    return ""


def skip_reason(name: str, device) -> str:
    """Why optimizer `name` cannot run on `device` ('' if it can)."""
    return MUONIUM_CPU_NOTE if name == "muonium" and device.type == "cpu" else ""


MUONIUM_CPU_NOTE = ("skipped on CPU: muonium 0.2.0's Newton-Schulz always runs its Triton Gram "
                    "kernel (muonium/kernels/gram.py asserts CUDA tensors), so it cannot step "
                    "CPU params")


# ---------------------------------------------------------------- the run

def batch_at(step: int, args, cfg, dp: int, data_rank: int):
    """This rank's slice of step's global batch (the same for every optimizer)."""
    import torch
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(cfg.vocab, (dp * args.batch, args.seq + 1), generator=g)
    mine = tokens[data_rank * args.batch:(data_rank + 1) * args.batch]
    return mine[:, :-1], mine[:, 1:]


def initial_model(args, cfg, device):
    """The seed-initialised model, built whole on `device`: what every rank
    builds before the layout shards it, for every optimizer."""
    import torch
    from llama.model import Llama
    torch.manual_seed(args.seed)
    with torch.device(device):
        return Llama(cfg)


def run_optimizer(name, args, cfg, mesh, rank, world, device, keep_state):
    """Trains --warmup + --steps steps with optimizer `name`; returns
    (the measurements, the final params gathered whole (rank 0, when
    keep_state))."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import train_dist
    from llama.model import tp_plan
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    gpu_used = GpuUsedPeak(device) if cuda else None
    # The same init on every rank and for every optimizer.
    model = train_dist.apply_layout(initial_model(args, cfg, device), args, mesh, device,
                                    plan=tp_plan())
    opt = {"muond": build_muond, "torch": RedundantTorchMuon,
           "muonium": build_muonium}[name](model, args)
    hyper = hyperparameters(opt)
    dp, data_rank = dp_size(args, world), train_dist.data_rank(args, mesh, rank)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    losses, times, phases, zero_ms, plan, daemon = [], [], [], [], None, None
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
    try:
        for step in range(args.warmup + args.steps):
            x, y = (t.to(device) for t in batch_at(step, args, cfg, dp, data_rank))
            sync()
            t0 = time.perf_counter()
            # muond: grads zeroed in its shared buffer, where backward (and
            # FSDP2's reduce-scatter) accumulates: no grad copy per step.
            if cuda:
                marks[0].record()
            if name == "muond":
                opt.zero_grad(set_to_none=False)
            else:
                opt.zero_grad()
            if cuda:
                marks[1].record()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if not args.no_split_sync:
                sync()
            t1 = time.perf_counter()
            opt.step()
            sync()
            t2 = time.perf_counter()
            losses.append(loss.detach().float())
            if step >= args.warmup:
                times.append((t1 - t0, t2 - t1, t2 - t0))
                if cuda:  # zero_grad's GPU time (inside fwd+bwd ms)
                    zero_ms.append(marks[0].elapsed_time(marks[1]))
                if name == "muond":
                    phases.append(step_phases_ms(opt.last_timings, 1e3 * (t2 - t1)))
        if name == "muond":
            daemon = daemon_memory(opt, rank)
            if rank == 0:
                plan = train_dist.plan_rank_load(world)
    finally:
        gpu_peak = gpu_used.stop() if gpu_used is not None else None
        if hasattr(opt, "close"):  # muond's unregisters from the daemons
            opt.close()
    # Max over ranks per step (the slowest rank sets the pace), then medians.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    fwd_bwd, opt_s, whole = (statistics.median(col) for col in t.t().tolist())
    # The global batch's loss: the mean of the data-parallel slices' means
    # (TP ranks of one slice hold the same loss, so the mean over all ranks).
    lv = torch.stack(losses).to(torch.float64)
    dist.all_reduce(lv)
    lv = (lv / world).tolist()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {
        "rank": rank, "mesh": train_dist.mesh_coordinates(args, mesh, rank),
        # This rank's own times per timed step: the table's medians are of
        # their per-step max over ranks (the all_reduce above).
        **{key: [1e3 * r[i] for r in times]
           for i, key in enumerate(("fwd_bwd_ms", "opt_step_ms", "step_ms"))},
        "opt_step_ms_median": 1e3 * statistics.median(r[1] for r in times),
        "peak_cuda_gib": peak, "gpu_used_peak_gib": gpu_peak,
        **({"peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "process_peak_gib": gpu_used.process_peaks()} if cuda else {}),
        **({"daemon_ns_ms_median": statistics.median(p["ns"] for p in phases),
            "muond_phases_ms_median": {k: statistics.median(p[k] for p in phases)
                                       for k in phases[0]}} if phases else {}),
        **({"zero_grad_ms_median": statistics.median(zero_ms)} if zero_ms else {}),
        **({"daemon": daemon} if daemon is not None else {})})
    state = train_dist.full_state(model) if keep_state else None
    if rank != 0:
        state = None
    tokens = dp * args.batch * args.seq
    result = {
        "optimizer": name, "tokens_per_step": tokens, "tokens_per_s": tokens / whole,
        "step_ms": 1e3 * whole, "fwd_bwd_ms": 1e3 * fwd_bwd, "opt_step_ms": 1e3 * opt_s,
        "opt_share": opt_s / whole, "loss_first": lv[0], "loss_last": lv[-1], "losses": lv,
        **memory_summary(per_rank), "hyperparameters": hyper, "ranks": per_rank,
    }
    if plan is not None:
        result["plan"] = plan
    del opt, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result, state


def step_phases_ms(timings: dict, opt_step_ms: float) -> dict:
    """One muond step's time split (ms): the daemon's phases (its StepTimings),
    its Step handler's work around the engine (checks, plan, record), gRPC's
    transport and wake-ups (the round trip minus the handler), and the
    trainer's own work before the Step is sent ("client": opt.step() minus
    the round trip: checks, grad copies, the synchronize)."""
    ms = {k[:-3]: v / 1e3 for k, v in timings.items()}
    return {"momentum": ms.get("momentum", 0.0), "ns": ms.get("ns", 0.0),
            "update": ms.get("update", 0.0),
            "exchange": sum(ms.get(k, 0.0) for k in ("a2a_fwd", "a2a_bwd", "dp_share")),
            "daemon_total": ms.get("total", 0.0),
            "handler_beyond_engine": ms.get("handler", 0.0) - ms.get("total", 0.0),
            "grpc_and_wakeups": ms.get("rpc", 0.0) - ms.get("handler", 0.0),
            "client": opt_step_ms - ms.get("rpc", 0.0)}


def daemon_memory(opt, rank: int) -> dict:
    """What this rank's muond daemon reports holding (GetStatus): state_bytes
    (momentum, AdamW moments of its shards) and peak_transient_bytes (exchange
    buffers). They live in the daemon process, on the trainer's GPU under
    `--device cuda`, so the trainer's torch.cuda.max_memory_allocated misses
    them. Not counted by the daemon either: its staged momentum copy and NS
    workspace."""
    try:
        mine = [s for s in opt.status() if s.rank == rank]
    except Exception as e:  # a report field, not a reason to fail the run
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    # The trainer's flat param and grad buffers the daemon maps (cudaMalloc,
    # outside torch's allocator: max_memory_allocated misses them too).
    buffers = [b for b in opt._buffers
               if b.flat is not None and b.flat.device.type == "cuda"]
    return {"state_gib": sum(s.state_bytes for s in mine) / 2**30,
            "transient_peak_gib": sum(s.peak_transient_bytes for s in mine) / 2**30,
            "ns_workspace_peak_gib": sum(s.peak_ns_workspace_bytes for s in mine) / 2**30,
            "trainer_buffers_gib": sum(b.flat.numel() * b.flat.element_size()
                                       for b in buffers) / 2**30}


def memory_summary(per_rank: list[dict]) -> dict:
    """Peak memory, max over ranks: the trainer process's CUDA allocations
    (None on CPU), muond's daemon state (+ exchange peak) where reported, and
    per GPU their sum (an upper bound on the GPU's peak: the two peaks need not
    coincide)."""
    trainer = [r["peak_cuda_gib"] for r in per_rank if r.get("peak_cuda_gib") is not None]
    daemons = [r["daemon"] for r in per_rank if "state_gib" in r.get("daemon", {})]
    out = {"peak_cuda_gib": max(trainer) if trainer else None}
    used = [r["gpu_used_peak_gib"] for r in per_rank if r.get("gpu_used_peak_gib") is not None]
    if used:
        out["gpu_used_peak_gib"] = max(used)
    if daemons:
        out["daemon_state_gib"] = max(d["state_gib"] for d in daemons)
        out["daemon_transient_peak_gib"] = max(d["transient_peak_gib"] for d in daemons)
        if trainer and len(daemons) == len(per_rank):
            out["peak_cuda_with_daemon_gib"] = max(
                r["peak_cuda_gib"] + r["daemon"]["state_gib"] + r["daemon"]["transient_peak_gib"]
                for r in per_rank)
    return out


def param_diff(mine: dict, ref: dict, init: dict, device) -> dict:
    """Per tensor ||mine - ref||_F / ||ref||_F (tests/gpu/test_exactness_vs_torch.py's
    measure) and ||ref - init||_F / ||init||_F (how far the reference moved it:
    the scale a difference is judged on); their maxima and where. In fp64 on
    `device`, one tensor at a time (1b: 1.5B params, seconds on a GPU)."""
    import torch
    per = {}
    for k in ref:
        x, y, y0 = (t[k].to(device, torch.float64) for t in (mine, ref, init))
        per[k] = (float((x - y).norm() / y.norm().clamp_min(1e-30)),
                  float((y - y0).norm() / y0.norm().clamp_min(1e-30)))
    worst = max(per, key=lambda k: per[k][0])
    by_ratio = max(per, key=lambda k: per[k][0] / max(per[k][1], 1e-30))
    return {"max_rel_diff": per[worst][0], "worst": worst,
            # How far torch moved the worst tensor itself: the scale its
            # difference is judged on (the minimum over tensors says nothing of it).
            "worst_ref_change": per[worst][1],
            "max_diff_over_change": per[by_ratio][0] / max(per[by_ratio][1], 1e-30),
            "worst_by_ratio": by_ratio,
            "reference_min_change": min(v[1] for v in per.values()),
            "measure": "max over tensors of ||mine - torch||_F / ||torch||_F",
            "per_tensor": {k: {"rel_diff": d, "ref_change": c} for k, (d, c) in per.items()}}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cfg = model_config(args)
    args.batch = args.batch or BATCH_DEFAULTS[args.model][0]
    args.seq = args.seq or BATCH_DEFAULTS[args.model][1]
    problem = layout_problem(args, cfg, world)
    if not problem:
        args.device = resolve_device(args)
        problem = check_environment(args)
    if problem:  # every rank refuses the same, before any collective
        print(f"llama_train_bench.py (rank {rank}): {problem}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    import train_dist
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(args.threads or (1 if world > 1 and device.type == "cpu"
                                           else min(4, os.cpu_count() or 1)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = train_dist.build_mesh(args, world, device.type)
    report = {
        "command": " ".join(sys.argv), "config": vars(args),
        "model": {**cfg.__dict__, "params": cfg.param_counts()},
        "layout": {"parallel": args.parallel, "world": world, "device": args.device,
                   "backend": dist.get_backend(),
                   "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
                   "dp_size": dp_size(args, world), "tp_size": tp_size(args, world),
                   **({"inner": args.inner} if args.parallel in TWO_D else {})},
        "tokens_per_step": dp_size(args, world) * args.batch * args.seq,
        "notes": optimizer_notes(args), "skipped": {}, "results": {}, "ratios": {},
        "versions": {"torch": torch.__version__},
    }
    # Final params vs torch's (rank 0 keeps them until both are there): muond's
    # is the correctness signal, muonium's a note (its math differs, notes).
    runnable = [n for n in args.optimizers if not skip_reason(n, device)]
    compared = ([n for n in runnable if n != "torch"]
                if "torch" in runnable and args.compare_params else [])
    states = {}
    for name in args.optimizers:
        why = skip_reason(name, device)
        if why:
            report["skipped"][name] = why
            continue
        if name == "muonium":
            report["versions"]["muonium"] = _version("muonium")
        if rank == 0:
            print(f"llama_train_bench: {name}: {args.parallel} on {world} ranks ...", flush=True)
        keep = bool(compared)
        try:
            result, state = run_optimizer(name, args, cfg, mesh, rank, world, device,
                                          keep_state=keep)
        except Exception as e:  # keep what the earlier optimizers measured, then fail
            if rank == 0:
                report["skipped"][name] = f"FAILED: {type(e).__name__}: {e}"[:2000]
                report["ratios"] = ratios(report["results"])
                print(write_outputs(report, args.out), flush=True)
                print(f"wrote {args.out}/{run_stem(report['layout'])}.json and .md "
                      f"({name} failed)", flush=True)
            raise
        report["results"][name] = result
        if state is not None:
            states[name] = state
        report["ratios"] = ratios(report["results"])
        if rank == 0:
            pending = [n for n in compared if n in states] if "torch" in states else []
            if pending:
                # The init rebuilt here (the same seed on the same device) rather
                # than gathered at the start and kept: one 1b copy less.
                init = {k: v.detach() for k, v in
                        initial_model(args, cfg, device).state_dict().items()}
                for other in pending:
                    cmp = param_diff(states.pop(other), states["torch"], init, device)
                    if other == "muond" and args.max_param_diff is not None:
                        cmp["max_param_diff"] = args.max_param_diff
                        # not <=: a NaN difference is a mismatch too
                        cmp["verdict"] = ("ok" if cmp["max_rel_diff"] <= args.max_param_diff
                                          else "MISMATCH")
                    report[f"params_{other}_vs_torch"] = cmp
                del init
            write_outputs(report, args.out)
    dist.destroy_process_group()
    if rank != 0:
        return 0
    print(write_outputs(report, args.out), flush=True)
    print(f"wrote {args.out}/{run_stem(report['layout'])}.json and .md", flush=True)
    # Rank 0 compared, so rank 0 fails the job (torchrun, then `muond launch`,
    # exit non-zero): no collective after the last optimizer's, whose teardown
    # could race the other ranks' exit.
    cmp = report.get("params_muond_vs_torch") or {}
    if cmp.get("verdict") == "MISMATCH":
        print(f"llama_train_bench.py: MISMATCH: muond's final params differ from torch's by "
              f"{cmp['max_rel_diff']:.3e} ({cmp['worst']}) > --max-param-diff "
              f"{args.max_param_diff}", file=sys.stderr)
        return 1
    return 0


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
