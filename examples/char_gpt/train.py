#!/usr/bin/env python3
"""Train a small character-level GPT on Debian's fortunes with Muon.

    python examples/char_gpt/train.py --optimizer reference --steps 300
    python examples/char_gpt/train.py --optimizer both \
        --daemons unix:///tmp/muond-demo-0.sock,...,unix:///tmp/muond-demo-3.sock \
        --gtp 2 --tp 2 --out out/demo

`--optimizer muond` steps through the muond daemons (muond.torch.Muon,
single-trainer split mode: every Muon matrix is sharded over the G x T
daemons as strided views of one shared-memory buffer); `reference` uses the
in-process ReferenceMuon of reference_muon.py; `both` runs the reference and
then muond from the same initial weights, data order and seed, and plots the
two curves together. Outputs in --out: report.md, loss.png, curves.json,
params_<optimizer>.safetensors.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the example's own modules; muond is the installed package

from data import batch_at, load_corpus, sample_starts  # noqa: E402
from options import add_common_args, muond_ns_options, state_description  # noqa: E402,E501  (shared with train_dist.py)
from model import CharGPT  # noqa: E402
from reference_muon import ReferenceMuon  # noqa: E402

SAMPLE_PROMPTS = ["The ", "Q: ", "A man ", "Love is "]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--optimizer", choices=["auto", "reference", "muond", "both"], default="auto",
                   help="auto = both when --daemons is given, else reference")
    p.add_argument("--daemons", default="",
                   help="comma-separated muond addresses, flat rank order g*T+t")
    p.add_argument("--gtp", type=int, default=0, help="GTP_remat size G (0: len(daemons)/T)")
    p.add_argument("--tp", type=int, default=0,
                   help="TP size T (0: 2 when there are 4 daemons, else 1)")
    p.add_argument("--job-id", default="demo")
    p.add_argument("--wait-healthy", type=float, default=60.0,
                   help="seconds to wait for the daemons to be healthy")
    p.add_argument("--out", default="out/demo")
    add_common_args(p)
    args = p.parse_args(argv)
    args.daemon_list = [a for a in args.daemons.split(",") if a]
    if args.optimizer == "auto":
        args.optimizer = "both" if args.daemon_list else "reference"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.optimizer in ("muond", "both"):
        n = len(args.daemon_list)
        if n == 0:
            p.error(f"--optimizer {args.optimizer} needs --daemons "
                    "(or use --optimizer reference to train without daemons)")
        if args.tp == 0:
            args.tp = 2 if n == 4 and args.gtp in (0, 2) else 1
        if args.gtp == 0:
            args.gtp = n // args.tp
        if args.gtp * args.tp != n:
            p.error(f"--gtp {args.gtp} x --tp {args.tp} != {n} daemons")
    else:
        args.gtp, args.tp = args.gtp or 1, args.tp or 1
    return args


def lr_multiplier(step: int, args) -> float:
    """step is 0-based; linear warmup, then cosine to 0.1 or constant."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if args.schedule == "constant":
        return 1.0
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(kind: str, model: CharGPT, args):
    muon, adamw = model.param_groups()
    adamw_group = dict(params=[p for _, p in adamw], param_names=[n for n, _ in adamw],
                       algorithm="adamw", lr=args.adamw_lr, betas=tuple(args.betas), eps=1e-8,
                       weight_decay=args.adamw_weight_decay)
    muon_group = dict(params=[p for _, p in muon], param_names=[n for n, _ in muon])
    common = dict(lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum,
                  nesterov=True, ns_steps=args.ns_steps, eps=1e-15,
                  coefficient_type=args.coefficient_type, scale_mode=args.scale_mode,
                  extra_scale_factor=args.extra_scale_factor)
    if kind == "reference":
        return ReferenceMuon([muon_group, adamw_group], **common)
    from muond.torch import Muon
    return Muon([muon_group, adamw_group], daemons=args.daemon_list, job_id=args.job_id,
                gtp_size=args.gtp, tp_size=args.tp, wait_healthy_timeout=args.wait_healthy,
                # Default fp32 standard NS, as ReferenceMuon's (--optimizer both).
                **muond_ns_options(args),
                **common)


class Progress:
    """A progress bar on a TTY, plain lines (every --log-every steps) otherwise."""

    def __init__(self, label: str, total: int, log_every: int, stream=sys.stdout):
        self.label, self.total, self.log_every, self.stream = label, total, log_every, stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, fields: str, force: bool = False) -> None:
        done = step + 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done)
        if self.tty:
            width = 24
            filled = int(width * done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{self.label}] [{bar}] {done}/{self.total} {fields} "
                              f"ETA {eta:5.0f}s\x1b[K")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif force or done % self.log_every == 0 or done == self.total or step == 0:
            print(f"[{self.label}] step {done}/{self.total} {fields} ETA {eta:.0f}s",
                  file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        print(f"[{self.label}] {text}", file=self.stream, flush=True)


@torch.no_grad()
def evaluate(model: CharGPT, data: torch.Tensor, args) -> float:
    g = torch.Generator().manual_seed(10_000 + args.seed)  # same val batches every time
    losses = []
    for _ in range(args.eval_batches):
        x, y = batch_at(data, sample_starts(g, len(data), args.batch, args.context), args.context)
        x, y = x.to(args.device), y.to(args.device)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


def params_checksum(state: dict[str, torch.Tensor]) -> dict:
    h = hashlib.sha256()
    total = 0.0
    for name in sorted(state):
        t = state[name].detach().contiguous().float()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
        total += float(t.double().abs().sum())
    return {"sha256": h.hexdigest(), "abs_sum": total}


def generate_samples(corpus, state: dict[str, torch.Tensor], args) -> list[str]:
    """Sampled on the CPU from the final weights: the seeded CPU generator
    gives the same samples whatever device or layout trained the model."""
    sampler = CharGPT(corpus.vocab_size, args.context, args.d_model, args.layers, args.heads)
    sampler.load_state_dict(state)
    sampler.eval()
    samples = []
    g = torch.Generator().manual_seed(args.seed)
    for prompt in SAMPLE_PROMPTS:
        idx = torch.tensor([corpus.encode(prompt)], dtype=torch.int64)
        out = sampler.generate(idx, args.sample_chars, generator=g)
        samples.append(corpus.decode(out[0]))
    return samples


def train_one(kind: str, corpus, args) -> dict:
    torch.manual_seed(args.seed)
    # Initialised on the CPU (same weights for every device), then moved.
    model = CharGPT(corpus.vocab_size, args.context, args.d_model, args.layers, args.heads)
    model.to(args.device)
    opt = build_optimizer(kind, model, args)
    base_lrs = [g["lr"] for g in opt.param_groups]
    data_gen = torch.Generator().manual_seed(args.seed)
    progress = Progress(kind, args.steps, args.log_every)
    curves = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    step_times, rpc_times, phase_sums = [], [], {}
    tokens = args.batch * args.context
    val_loss = float("nan")  # shown as "-" until the first evaluation
    t_start = time.perf_counter()
    try:
        for step in range(args.steps):
            mult = lr_multiplier(step, args)
            for group, base in zip(opt.param_groups, base_lrs):
                group["lr"] = base * mult
            x, y = batch_at(corpus.train, sample_starts(data_gen, len(corpus.train), args.batch,
                                                        args.context), args.context)
            x, y = x.to(args.device), y.to(args.device)
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            t0 = time.perf_counter()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            timing = ""
            if kind == "muond":
                t = opt.last_timings
                rpc_times.append(t["rpc_us"] / 1e6)
                for k, v in t.items():
                    phase_sums[k] = phase_sums.get(k, 0.0) + v
                # Daemon phases are each the max over daemons, so ns + a2a can
                # exceed the slowest daemon's total.
                timing = (f"opt {step_times[-1]*1e3:6.1f}ms (rpc {t['rpc_us']/1e3:.1f} = daemon "
                          f"{t['total_us']/1e3:.1f} [max: ns {t['ns_us']/1e3:.1f} a2a "
                          f"{(t['a2a_fwd_us'] + t['a2a_bwd_us'])/1e3:.1f}] + overhead "
                          f"{t['overhead_us']/1e3:.1f})")
            else:
                timing = f"opt {step_times[-1]*1e3:6.1f}ms"
            curves["step"].append(step + 1)
            curves["train_loss"].append(loss.item())
            evaluated = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
            if evaluated:
                val_loss = evaluate(model, corpus.val, args)
                curves["val_step"].append(step + 1)
                curves["val_loss"].append(val_loss)
            tok_s = tokens * (step + 1) / (time.perf_counter() - t_start)
            val_text = "-" if math.isnan(val_loss) else f"{val_loss:.3f}"
            progress.update(step, f"loss {loss.item():.3f} val {val_text} "
                                  f"{tok_s:,.0f} tok/s {timing}", force=evaluated)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_start
        state = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
        samples = generate_samples(corpus, state, args)
    finally:
        if hasattr(opt, "close"):
            opt.close()
    n = len(step_times)
    result = {
        "optimizer": kind,
        "curves": curves,
        "final_train_loss": sum(curves["train_loss"][-10:]) / len(curves["train_loss"][-10:]),
        "final_val_loss": curves["val_loss"][-1],
        "wall_s": wall,
        "tokens_per_s": tokens * args.steps / wall,
        "opt_step_ms_mean": 1e3 * sum(step_times) / n,
        # Without step 1's warm-up, which the mean carries.
        "opt_step_ms_median": 1e3 * statistics.median(step_times),
        "checksum": params_checksum(state),
        "samples": samples,
    }
    if kind == "muond":
        result["rpc_ms_mean"] = 1e3 * sum(rpc_times) / n
        result["daemon_phases_ms_mean"] = {k: v / n / 1e3 for k, v in phase_sums.items()}
    progress.note(f"done in {wall:.1f}s: train {result['final_train_loss']:.3f} "
                  f"val {result['final_val_loss']:.3f} nats/char")
    return result, state


def plot(results: dict, baseline: float, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # e.g. a bare GPU node: curves.json still has the curves
        print(f"matplotlib not installed: {path} not drawn (curves in curves.json)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    # muond wide and underneath, the reference thin and dashed on top: where the
    # two runs agree (they should) both stay visible.
    styles = {"muond": ("tab:red", "-", 3.0, 0.45), "reference": ("tab:blue", "--", 1.2, 0.9)}
    for kind in sorted(results, key=lambda k: k != "muond"):
        color, ls, lw, alpha = styles[kind]
        c = results[kind]["curves"]
        ax.plot(c["step"], c["train_loss"], color=color, ls=ls, alpha=alpha * 0.6, lw=lw,
                label=f"{kind} train")
        ax.plot(c["val_step"], c["val_loss"], color=color, ls=ls, marker="o", ms=3 + lw,
                lw=lw + 0.5, alpha=alpha, label=f"{kind} validation")
    ax.axhline(baseline, color="gray", ls=":", label=f"unigram baseline {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("char GPT on fortunes: muond vs in-process reference Muon")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst


def write_report(args, corpus, baseline, results, rel_diff, path):
    lines = ["# char GPT on fortunes, trained with Muon", ""]
    lines += ["## Configuration", "", "```",
              " ".join(sys.argv), "```", "",
              f"- data: {corpus.num_train_fortunes} train / {corpus.num_val_fortunes} validation "
              f"fortunes ({len(corpus.train):,} / {len(corpus.val):,} chars, "
              f"vocabulary {corpus.vocab_size}), split seed {args.data_seed}",
              f"- model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
              f"context {args.context}, batch {args.batch}, seed {args.seed}, "
              f"device {args.device}",
              f"- Muon: lr {args.lr}, momentum {args.momentum} (Nesterov), weight decay "
              f"{args.weight_decay} (decoupled), {args.coefficient_type} x {args.ns_steps}, "
              f"scale {args.scale_mode} x {args.extra_scale_factor}; muond's "
              f"{state_description(args)}",
              f"- AdamW (embeddings, norms, biases, head): lr {args.adamw_lr}, betas "
              f"{tuple(args.betas)}, weight decay {args.adamw_weight_decay}",
              f"- schedule: {args.warmup} warmup steps, then {args.schedule}; {args.steps} steps",
              ]
    if "muond" in results:
        lines.append(f"- muond: {len(args.daemon_list)} daemons as a {args.gtp}x{args.tp} "
                     f"GTP_remat x TP domain, job {args.job_id}")
    lines += ["", "## Results (nats/char)", "",
              f"Unigram baseline (validation under train char frequencies): **{baseline:.3f}**", "",
              "| optimizer | final train (mean last 10) | final validation | wall s | tokens/s "
              "| opt step ms |", "|---|---|---|---|---|---|"]
    for kind, r in results.items():
        lines.append(f"| {kind} | {r['final_train_loss']:.3f} | {r['final_val_loss']:.3f} | "
                     f"{r['wall_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['opt_step_ms_mean']:.2f} |")
    if "muond" in results:
        r = results["muond"]
        ph = r["daemon_phases_ms_mean"]
        lines += ["", "## muond step timings (mean ms per step; daemon phases: max over daemons)",
                  "", "| rpc (client wall) | daemon total | momentum | a2a fwd | NS | a2a bwd "
                  "| update | client overhead |", "|---|---|---|---|---|---|---|---|",
                  f"| {r['rpc_ms_mean']:.2f} | {ph['total_us']:.2f} | {ph['momentum_us']:.2f} | "
                  f"{ph['a2a_fwd_us']:.2f} | {ph['ns_us']:.2f} | {ph['a2a_bwd_us']:.2f} | "
                  f"{ph['update_us']:.2f} | {ph['overhead_us']:.2f} |"]
    if rel_diff is not None:
        lines += ["", f"Max relative difference of the final params, muond vs reference "
                      f"(max |a-b| / max |b| per tensor): **{rel_diff:.3e}**"]
    write_report_tail(path, lines, results)


def write_report_tail(path: str, lines: list, results: dict) -> None:
    """Ends a report with the loss plot and each run's samples, and writes it
    (train.py's and train_dist.py's reports)."""
    lines += ["", "![loss](loss.png)", "", "## Samples (temperature 0.8)", ""]
    for kind, r in results.items():
        lines += [f"### {kind}", ""]
        for s in r["samples"]:
            lines += ["```", s.rstrip(), "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or min(4, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    corpus = load_corpus(args.val_fraction, args.data_seed)
    baseline = corpus.unigram_baseline()
    print(f"fortunes: {corpus.num_train_fortunes} train / {corpus.num_val_fortunes} val fortunes, "
          f"{len(corpus.train):,} / {len(corpus.val):,} chars, vocab {corpus.vocab_size}; "
          f"unigram baseline {baseline:.3f} nats/char", flush=True)
    kinds = ["reference", "muond"] if args.optimizer == "both" else [args.optimizer]
    results, states = {}, {}
    from safetensors.torch import save_file
    for kind in kinds:
        results[kind], states[kind] = train_one(kind, corpus, args)
        save_file(states[kind], os.path.join(args.out, f"params_{kind}.safetensors"))
    rel_diff = max_rel_diff(states["muond"], states["reference"]) if len(states) == 2 else None
    if rel_diff is not None:
        print(f"max relative param difference muond vs reference: {rel_diff:.3e}")
    plot(results, baseline, os.path.join(args.out, "loss.png"))
    write_report(args, corpus, baseline, results, rel_diff, os.path.join(args.out, "report.md"))
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items()},
                   "unigram_baseline": baseline, "max_rel_param_diff": rel_diff,
                   "runs": results}, f, indent=1)
    print(f"wrote {args.out}/report.md, loss.png, curves.json, params_*.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
