#!/usr/bin/env python3
"""The char GPT as a torchrun job: PyTorch's parallelism, muond's optimizer.

    torchrun --standalone --nproc-per-node 4 examples/char_gpt/train_dist.py \
        --parallel fsdp+tp --steps 300 --out out/demo

Every rank builds the same model (same seed), applies the layout with
PyTorch's own APIs and creates the optimizer in one line, with no addresses,
ranks or (g, t):

    opt = Muon([{"params": matrices}, {"params": others, "algorithm": "adamw"}], lr=...)

muond.torch.Muon finds its rank's daemon and the job from the environment
(MUOND_JOB_ID, MUOND_TOKEN_FILE, RANK; docs/parallelism.md) and derives each
param's place from its DTensor placements (or, for DDP, from the process
group). deploy/local/launch.py (deploy/run-demo.sh) starts the coordinator and
one daemon per rank and sets that environment.

Layouts (--parallel; W = world size, I = --inner, default 2):
  ddp      DistributedDataParallel, W replicas
  fsdp     fully_shard over W ranks (FSDP2, dim-0 shards)
  tp       parallelize_module, W-way tensor parallel (q/k/v/up colwise, o/down rowwise)
  fsdp+tp  2-D mesh (W/I, I) = ("dp", "tp"): TP inside, fully_shard over "dp"
  hsdp     2-D mesh (W/I, I) = ("replicate", "shard"): fully_shard on both (HSDP)

Data: every rank draws the same global batch of --batch sequences (same
generator as train.py) and keeps its data-parallel slice, so the job trains
on exactly what the single-process reference trains on. With --optimizer
both (default), rank 0 then trains the in-process reference (ReferenceMuon,
one process, the same global batches) and writes report.md, loss.png and
curves.json with both runs, the layout and each rank's NS load.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import statistics
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the example's own modules; muond is the installed package

import train  # noqa: E402  (shared options, schedule, evaluation, plot)
from data import batch_at, load_corpus, sample_starts  # noqa: E402
from model import CharGPT  # noqa: E402
from options import (TWO_D, check_layout, dist_parser, dp_size, muond_ns_options,  # noqa: E402
                     ns_description, state_description, tp_size)


def parse_args(argv=None):
    return dist_parser(description=__doc__.split("\n\n")[0]).parse_args(argv)


def build_mesh(args, world: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh
    if args.parallel in TWO_D:
        return init_device_mesh(device_type, (world // args.inner, args.inner),
                                mesh_dim_names=TWO_D[args.parallel])
    name = {"ddp": "dp", "fsdp": "fsdp", "tp": "tp"}[args.parallel]
    return init_device_mesh(device_type, (world,), mesh_dim_names=(name,))


# Megatron's split of a block: q/k/v and MLP up split output rows (tp_dim 0),
# attention output and MLP down split input columns (tp_dim 1).
def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def apply_layout(model: CharGPT, args, mesh, device: torch.device, plan=None):
    """The layout with PyTorch's own APIs; returns the module to train. plan:
    the blocks' TP plan (default tp_plan(); bench/llama adds its MLP gate)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.parallel in ("tp", "fsdp+tp"):
        tp_mesh = mesh["tp"]
        for block in model.blocks:
            parallelize_module(block, tp_mesh, plan or tp_plan())
    if args.parallel in ("fsdp", "fsdp+tp", "hsdp"):
        # fsdp: 1-D; fsdp+tp: over "dp"; hsdp: the 2-D (replicate, shard) mesh.
        shard_mesh = mesh["dp"] if args.parallel == "fsdp+tp" else mesh
        for block in model.blocks:
            fully_shard(block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    return model


def data_rank(args, mesh, rank: int) -> int:
    """This rank's slice of the global batch (TP ranks of one group share it)."""
    if args.parallel == "tp":
        return 0
    if args.parallel == "fsdp+tp":
        return mesh["dp"].get_local_rank()
    return rank


def mesh_coordinates(args, mesh, rank: int) -> str:
    names = mesh.mesh_dim_names or ()
    coords = mesh.get_coordinate() or []
    return ", ".join(f"{n}={c}" for n, c in zip(names, coords)) or f"rank={rank}"


class _DropSequentialGatherNote(logging.Filter):
    """DTensor logs, from every rank, that gathering an fsdp+tp param
    (_StridedShard(0) x Shard) takes sequential all_gathers on an unflattened
    mesh. Right, and irrelevant for this one-off gather of the final params
    for the comparison with the reference: only that note is dropped."""

    def filter(self, record):
        return not str(record.msg).startswith("While redistributing from")


def full_state(model) -> dict[str, torch.Tensor]:
    """Every param gathered whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet = _DropSequentialGatherNote()
    logger.addFilter(quiet)
    try:
        out = {}
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t = t.full_tensor()
            out[name.removeprefix("module.")] = t.detach().cpu().clone().contiguous()
        return out
    finally:
        logger.removeFilter(quiet)


def build_optimizer(model, args, eps: float = 1e-15):
    """The one line of a torchrun script: no addresses, ranks or (g, t).
    eps: NS's normalisation epsilon; 1e-15 matches the char-GPT reference
    (train.py), bench/llama_train_bench.py passes torch.optim.Muon's 1e-7."""
    from muond.torch import Muon
    inner = model.module if hasattr(model, "module") else model
    muon, adamw = inner.param_groups()
    return Muon([{"params": [p for _, p in muon], "param_names": [n for n, _ in muon]},
                 {"params": [p for _, p in adamw], "param_names": [n for n, _ in adamw],
                  "algorithm": "adamw", "lr": args.adamw_lr, "betas": tuple(args.betas),
                  "eps": 1e-8, "weight_decay": args.adamw_weight_decay}],
                lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum,
                nesterov=True, ns_steps=args.ns_steps, eps=eps,
                coefficient_type=args.coefficient_type, scale_mode=args.scale_mode,
                extra_scale_factor=args.extra_scale_factor,
                # Default fp32 standard NS, as ReferenceMuon's (the overlay).
                **muond_ns_options(args),
                wait_healthy_timeout=args.wait_healthy)


def daemon_status(opt) -> dict:
    """This rank's daemon as GetStatus reports it (empty if not reachable)."""
    try:
        s = opt.clients[0].status()
    except Exception as e:  # a report field, never a reason to fail the run
        return {"error": str(e)}
    return {"daemon_rank": s.rank, "device": s.device, "num_params": s.num_params,
            "plan_version": s.plan_version, "state_bytes": s.state_bytes,
            "last_step_us": {f.name: getattr(s.last_timings, f.name)
                             for f in s.last_timings.DESCRIPTOR.fields}}


def plan_rank_load(world: int) -> dict:
    """The coordinator's plan (GetPlan): NS cost homed on each flat domain
    rank, summed over the groups whose domain spans the W ranks (in these
    layouts the flat domain rank (d*G + g)*T + t is the global rank)."""
    address = os.environ.get("MUOND_COORDINATOR", "")
    if not address:
        return {"error": "MUOND_COORDINATOR not set"}
    try:
        import grpc
        from muond.client import _TokenInterceptor, read_token_file
        from muond.v1 import muond_pb2, muond_pb2_grpc
        channel = grpc.insecure_channel(address)
        token_file = os.environ.get("MUOND_TOKEN_FILE")
        if token_file:
            channel = grpc.intercept_channel(channel, _TokenInterceptor(
                read_token_file(token_file)))
        with channel:
            plan = muond_pb2_grpc.CoordinatorStub(channel).GetPlan(
                muond_pb2.GetPlanRequest(job_id=os.environ.get("MUOND_JOB_ID", "default")),
                timeout=10)
    except Exception as e:  # a report field, never a reason to fail the run
        detail = f"{e.code().name}: {e.details()}" if hasattr(e, "details") else str(e)
        return {"error": f"GetPlan at {address}: {detail}"}
    load = [0.0] * world
    groups = []
    for gp in plan.groups:
        if len(gp.rank_load) == world:
            groups.append(gp.group)
            for r, v in enumerate(gp.rank_load):
                load[r] += v
    return {"version": plan.version, "groups": groups, "rank_load": load}


def train_distributed(corpus, args, rank: int, world: int, device: torch.device) -> dict:
    mesh = build_mesh(args, world, device.type)
    torch.manual_seed(args.seed)  # the same init as the reference's on every rank
    model = CharGPT(corpus.vocab_size, args.context, args.d_model, args.layers, args.heads,
                    megatron_tags=False).to(device)
    model = apply_layout(model, args, mesh, device)
    opt = build_optimizer(model, args)
    base_lrs = [g["lr"] for g in opt.param_groups]
    data_gen = torch.Generator().manual_seed(args.seed)
    local_batch = args.batch // dp_size(args, world)
    first = data_rank(args, mesh, rank) * local_batch
    progress = train.Progress(f"muond {args.parallel}", args.steps, args.log_every,
                              stream=sys.stdout if rank == 0 else open(os.devnull, "w"))
    curves = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    step_times, phase_sums = [], {}
    tokens = args.batch * args.context
    val_loss = float("nan")
    t_start = time.perf_counter()
    try:
        for step in range(args.steps):
            for group, base in zip(opt.param_groups, base_lrs):
                group["lr"] = base * train.lr_multiplier(step, args)
            x, y = batch_at(corpus.train, sample_starts(data_gen, len(corpus.train), args.batch,
                                                        args.context), args.context)
            x, y = x[first:first + local_batch].to(device), y[first:first + local_batch].to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            for k, v in opt.last_timings.items():
                phase_sums[k] = phase_sums.get(k, 0.0) + v
            # The global batch's loss: the mean of the data-parallel slices' means.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss = float(global_loss) / world
            curves["step"].append(step + 1)
            curves["train_loss"].append(global_loss)
            evaluated = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
            if evaluated:
                val_loss = train.evaluate(model, corpus.val, args)
                curves["val_step"].append(step + 1)
                curves["val_loss"].append(val_loss)
            t = opt.last_timings
            tok_s = tokens * (step + 1) / (time.perf_counter() - t_start)
            progress.update(step, f"loss {global_loss:.3f} val "
                            f"{'-' if math.isnan(val_loss) else f'{val_loss:.3f}'} "
                            f"{tok_s:,.0f} tok/s opt {step_times[-1] * 1e3:6.1f}ms (rank 0: "
                            f"daemon {t.get('total_us', 0) / 1e3:.1f} ns "
                            f"{t.get('ns_us', 0) / 1e3:.1f})", force=evaluated)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_start
        status = daemon_status(opt)
    finally:
        opt.close()
    state = full_state(model)
    n = len(step_times)
    mine = {"rank": rank, "mesh": mesh_coordinates(args, mesh, rank),
            "opt_step_ms_mean": 1e3 * sum(step_times) / n,
            "opt_step_ms_median": 1e3 * statistics.median(step_times),
            "daemon_phases_ms_mean": {k: v / n / 1e3 for k, v in phase_sums.items()},
            "daemon": status}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    result = {
        "optimizer": "muond", "curves": curves,
        "final_train_loss": sum(curves["train_loss"][-10:]) / len(curves["train_loss"][-10:]),
        "final_val_loss": curves["val_loss"][-1], "wall_s": wall,
        "tokens_per_s": tokens * args.steps / wall,
        "opt_step_ms_mean": ranks[0]["opt_step_ms_mean"],
        "opt_step_ms_median": ranks[0]["opt_step_ms_median"],
        "checksum": train.params_checksum(state),
    }
    layout = {"parallel": args.parallel, "world": world,
              "backend": dist.get_backend(), "device": args.device,
              "mesh": dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
              "dp_size": dp_size(args, world), "tp_size": tp_size(args, world),
              "ranks": ranks}
    if rank == 0:
        progress.note(f"done in {wall:.1f}s: train {result['final_train_loss']:.3f} "
                      f"val {result['final_val_loss']:.3f} nats/char")
        layout["plan"] = plan_rank_load(world)
    return result, state, layout


def ns_load_rows(layout: dict) -> list[str]:
    plan = layout.get("plan", {})
    load = plan.get("rank_load")
    total = sum(load) if load else 0.0
    rows = ["| rank | mesh | plan NS load (ns_cost) | share | NS ms/step | daemon total "
            "ms/step | dp_share ms (last step) | daemon state MiB |",
            "|---|---|---|---|---|---|---|---|"]
    for r in layout["ranks"]:
        ph = r["daemon_phases_ms_mean"]
        cost = f"{load[r['rank']]:.3g}" if load else "-"
        share = f"{load[r['rank']] / total:.1%}" if load and total > 0 else "-"
        state = r["daemon"].get("state_bytes")
        dp_share = r["daemon"].get("last_step_us", {}).get("dp_share_us")
        rows.append(f"| {r['rank']} | {r['mesh']} | {cost} | {share} | "
                    f"{ph.get('ns_us', 0.0):.2f} | {ph.get('total_us', 0.0):.2f} | "
                    f"{'-' if dp_share is None else f'{dp_share / 1e3:.2f}'} | "
                    f"{'-' if state is None else f'{state / 2**20:.2f}'} |")
    if "error" in plan:
        rows += ["", f"(plan NS load unavailable: {plan['error']})"]
    elif load:
        rows += ["", f"Plan version {plan['version']}, groups {', '.join(plan['groups'])}; "
                     f"an even split would give each rank {1 / len(load):.1%}."]
    return rows


def write_report(args, corpus, baseline, results, rel_diff, layout, path):
    mesh = " x ".join(f"{n} {s}" for n, s in layout["mesh"].items())
    lines = ["# char GPT on fortunes: a torchrun job with muond", "", "## Configuration", "",
             "```", " ".join(sys.argv), "```", "",
             f"- layout: **{args.parallel}**, {layout['world']} trainer processes "
             f"({layout['backend']}, {args.device}), mesh {mesh}; data parallel "
             f"{layout['dp_size']}, tensor parallel {layout['tp_size']}; one muond per rank",
             f"- global batch {args.batch} sequences ({args.batch // layout['dp_size']} per "
             f"data-parallel rank), the same batches as the reference",
             f"- data: {corpus.num_train_fortunes} train / {corpus.num_val_fortunes} validation "
             f"fortunes, vocabulary {corpus.vocab_size}, split seed {args.data_seed}",
             f"- model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
             f"context {args.context}, seed {args.seed}",
             f"- Muon: lr {args.lr}, momentum {args.momentum} (Nesterov), weight decay "
             f"{args.weight_decay}, {args.coefficient_type} x {args.ns_steps}, scale "
             f"{args.scale_mode} x {args.extra_scale_factor}, {ns_description(args)}, "
             f"{state_description(args)}; AdamW (embeddings, "
             f"norms, biases, head): lr {args.adamw_lr}, betas {tuple(args.betas)}",
             f"- schedule: {args.warmup} warmup steps, then {args.schedule}; {args.steps} steps",
             "", "## Results (nats/char)", "",
             f"Unigram baseline: **{baseline:.3f}**", "",
             "| run | final train (mean last 10) | final validation | wall s | tokens/s "
             "| opt step ms (median) |", "|---|---|---|---|---|---|"]
    for kind, r in results.items():
        label = f"muond ({args.parallel}, {layout['world']} ranks)" if kind == "muond" else \
            "reference (1 process, in-process Muon)"
        lines.append(f"| {label} | {r['final_train_loss']:.3f} | {r['final_val_loss']:.3f} | "
                     f"{r['wall_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['opt_step_ms_median']:.2f} |")
    lines += ["", "opt step ms: the median over the steps of `opt.step()` (rank 0's for muond); "
                  "the mean would carry step 1's warm-up (plan, registration, first kernels), "
                  "many times a later step.", "",
              f"On a CPU machine ({os.cpu_count()} cores here) the {layout['world']} trainer "
              "and daemon processes share the cores, so these per-step times are not a speed "
              "comparison of the two optimizers (bench/ has those)." if args.device == "cpu"
              else "Step times of a GPU run: bench/results/ has the benchmarks."]
    if rel_diff is not None:
        lines += ["", "Max relative difference of the final params, muond vs reference "
                      f"(max |a-b| / max |b| per tensor): **{rel_diff:.3e}**"]
    lines += ["", "## Newton–Schulz load per rank", "",
              "Plan NS load: the coordinator's plan (`GroupPlan.rank_load` of the Muon groups, "
              "as `muonctl status` reads it); "
              "ms/step: each rank's daemon (its StepTimings, mean over steps; dp_share: the last "
              "step's, from GetStatus).", ""]
    lines += ns_load_rows(layout)
    train.write_report_tail(path, lines, results)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:
        check_layout(args, world)
    except ValueError as e:
        print(f"train_dist.py (rank {rank}): {e}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(1 if world > 1 and device.type == "cpu" else
                          (args.threads or min(4, os.cpu_count() or 1)))
    corpus = load_corpus(args.val_fraction, args.data_seed)
    baseline = corpus.unigram_baseline()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"fortunes: {corpus.num_train_fortunes} train / {corpus.num_val_fortunes} val, "
              f"vocab {corpus.vocab_size}; unigram baseline {baseline:.3f} nats/char; layout "
              f"{args.parallel} on {world} ranks", flush=True)
    result, state, layout = train_distributed(corpus, args, rank, world, device)
    # The model's FSDP/DTensor state sits in reference cycles that hold gloo
    # work objects; collected at interpreter exit, after the groups are gone,
    # they can abort the process. Collect them while the groups still exist.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    from safetensors.torch import save_file
    result["samples"] = train.generate_samples(corpus, state, args)
    results = {"muond": result}
    save_file(state, os.path.join(args.out, "params_muond.safetensors"))
    rel_diff = None
    if args.optimizer == "both":
        # The reference: one process, the whole model, the same global batches.
        torch.set_num_threads(args.threads or min(4, os.cpu_count() or 1))
        results["reference"], ref_state = train.train_one("reference", corpus, args)
        save_file(ref_state, os.path.join(args.out, "params_reference.safetensors"))
        rel_diff = train.max_rel_diff(state, ref_state)
        print(f"max relative param difference muond vs reference: {rel_diff:.3e}")
    train.plot(results, baseline, os.path.join(args.out, "loss.png"))
    write_report(args, corpus, baseline, results, rel_diff, layout,
                 os.path.join(args.out, "report.md"))
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump({"config": vars(args), "layout": layout, "unigram_baseline": baseline,
                   "max_rel_param_diff": rel_diff, "runs": results}, f, indent=1)
    print(f"wrote {args.out}/report.md, loss.png, curves.json, params_*.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
