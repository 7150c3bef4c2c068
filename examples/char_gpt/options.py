"""The char GPT's options and the torchrun trainer's layout rule, without torch.

train.py and train_dist.py build their parsers from here; deploy/local/launch.py
--check-args parses the trainer's options (the ones after `--`) with
dist_parser() and checks them with check_layout(), the rule train_dist.py
applies on every rank, so a launch that every rank would refuse after the
build is refused before it (and in well under a second: no torch import).
"""
from __future__ import annotations

import argparse

LAYOUTS = ("ddp", "fsdp", "tp", "fsdp+tp", "hsdp")
TWO_D = {"fsdp+tp": ("dp", "tp"), "hsdp": ("replicate", "shard")}
# The launcher's bound on local ranks; also how far check_layout looks for a
# world size that fits.
MAX_WORLD = 64


def restart_list(text: str) -> list[int]:
    """--gram-restarts: "2,4" -> [2, 4] (muond checks the values)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of ints such as 2 or 2,4, got {text!r}") from None


def muond_ns_options(args) -> dict:
    """The NS and optimizer-state keyword arguments of muond.torch.Muon from the
    options above."""
    return dict(fp32_matmul_prec=args.fp32_matmul_prec, ns_algorithm=args.ns_algorithm,
                gram_dtype=args.gram_dtype, gram_restarts=args.gram_restarts,
                state_dtype=args.state_dtype, state_location=args.state_location,
                # Only where the caller names one: muond's default otherwise.
                **({"ns_batch_size": args.ns_batch_size}
                   if getattr(args, "ns_batch_size", None) is not None else {}))


def state_description(args) -> str:
    """Where and in what precision muond keeps the optimizer state, for the report."""
    dtype = "auto (the params' dtype)" if args.state_dtype == "auto" else args.state_dtype
    return f"optimizer state {dtype} on the {args.state_location}"


def ns_description(args) -> str:
    """How muond's NS runs, for the report."""
    prec = {"highest": "fp32", "high": "TF32", "medium": "bf16"}[args.fp32_matmul_prec]
    if args.ns_algorithm == "standard" or (args.ns_algorithm == "auto"
                                           and args.fp32_matmul_prec != "medium"):
        return f"{prec} NS"
    if args.ns_algorithm == "auto":
        return f"{prec} NS, Gram NS ({args.gram_dtype}) on wide/tall matrices"
    restarts = "default" if args.gram_restarts is None else args.gram_restarts
    dtype = args.gram_dtype if args.fp32_matmul_prec == "medium" else "fp32"
    return f"Gram NS ({dtype} iteration, restarts {restarts})"


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Data, model, optimizer and reporting options, shared with train_dist.py."""
    p.add_argument("--seed", type=int, default=0, help="init, data order and sampling seed")
    p.add_argument("--data-seed", type=int, default=1234, help="train/validation split seed")
    p.add_argument("--val-fraction", type=float, default=0.1)
    # model
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    # optimizer
    p.add_argument("--lr", type=float, default=1e-2, help="Muon lr")
    p.add_argument("--adamw-lr", type=float, default=1e-2)
    p.add_argument("--momentum", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.1, help="Muon weight decay")
    p.add_argument("--adamw-weight-decay", type=float, default=0.0)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--coefficient-type", choices=["quintic", "simple"], default="quintic")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--scale-mode", choices=["spectral", "shape_scaling", "unit_rms_norm"],
                   default="spectral")
    p.add_argument("--extra-scale-factor", type=float, default=0.2)
    # muond's NS options (the in-process reference always runs standard NS in fp32)
    p.add_argument("--fp32-matmul-prec", choices=["highest", "high", "medium"],
                   default="highest",
                   help="muond's NS precision; highest (fp32) is what the reference runs, so "
                        "the overlay compares like with like; high = TF32, medium = bf16 "
                        "(muond.torch.Muon's own default, as torch.optim.Muon)")
    p.add_argument("--ns-algorithm", choices=["auto", "standard", "gram"], default="auto",
                   help="auto (muond's default) = Gram Newton-Schulz on wide/tall matrices "
                        "under --fp32-matmul-prec medium, standard NS otherwise; gram = Gram "
                        "at any precision (client/python/README.md, 'Gram Newton-Schulz')")
    p.add_argument("--gram-dtype", choices=["fp16", "bf16"], default="fp16",
                   help="Gram NS iteration dtype under --fp32-matmul-prec medium")
    p.add_argument("--gram-restarts", type=restart_list, default=None,
                   help="Gram NS restart iterations, comma list (e.g. 2 or 2,4); "
                        "default: muond's table for the coefficient set")
    p.add_argument("--state-dtype", choices=["auto", "fp32", "bf16", "fp8_e4m3"],
                   default="auto",
                   help="muond's optimizer state (momentum, AdamW moments): auto = the "
                        "params' dtype as torch keeps it; fp8_e4m3 = 8-bit, blockwise scaled")
    p.add_argument("--state-location", choices=["device", "host"], default="device",
                   help="where muond's daemon keeps the state: host = pinned host memory, "
                        "streamed while NS runs (no state in GPU memory)")
    p.add_argument("--warmup", type=int, default=10, help="linear lr warmup steps")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="after warmup: cosine to 10%% of the lr, or constant")
    # reporting
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10, help="plain-line period (non-TTY)")
    p.add_argument("--sample-chars", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores, max 4)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where model and data live; cuda = the current GPU, params reach "
                        "the daemons by CUDA IPC (the daemons must serve that GPU)")


def dist_parser(description: str = "", prog: str | None = None) -> argparse.ArgumentParser:
    """train_dist.py's options (its parse_args)."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parallel", choices=LAYOUTS, default="fsdp+tp", help="the layout")
    p.add_argument("--inner", type=int, default=2,
                   help="inner mesh dim of the 2-D layouts (fsdp+tp: TP size; hsdp: shard "
                        "group size)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--optimizer", choices=["both", "muond"], default="both",
                   help="both = rank 0 also trains the in-process reference for the overlay")
    p.add_argument("--wait-healthy", type=float, default=60.0,
                   help="seconds to wait for the daemons to be healthy")
    p.add_argument("--out", default="out/demo")
    add_common_args(p)
    return p


def tp_size(args, world: int) -> int:
    return {"tp": world, "fsdp+tp": args.inner}.get(args.parallel, 1)


def dp_size(args, world: int) -> int:
    return world // tp_size(args, world)


def layout_problem(args, world: int) -> tuple[str, str]:
    """(the broken rule, the trainer options that would fix it) for this world
    size; ('', '') when the layout fits."""
    if args.parallel in TWO_D and (args.inner < 1 or world % args.inner):
        return (f"--parallel {args.parallel} lays the {world} processes (world size {world}) out as a "
                f"(N / {args.inner}) x {args.inner} mesh (--inner {args.inner}): "
                f"--nproc must be a multiple of {args.inner}", "")
    tp = tp_size(args, world)
    if tp > 1 and args.heads % tp:
        return (f"--parallel {args.parallel}: --heads {args.heads} is not divisible by the TP "
                f"size {tp} (ColwiseParallel splits q/k/v by head)", heads_fix(args, tp))
    dp = dp_size(args, world)
    if args.batch % dp:
        fixed = dp * max(1, round(args.batch / dp))
        return (f"--batch {args.batch} (the global batch) is not divisible by the {dp} "
                f"data-parallel ranks of --parallel {args.parallel}", f"--batch {fixed}")
    return "", ""


def heads_fix(args, tp: int) -> str:
    """Heads a multiple of tp that divide --d-model, else as many heads of the
    same width (d_model / heads) as needed."""
    for heads in range(tp, args.d_model + 1, tp):
        if heads >= args.heads and args.d_model % heads == 0:
            return f"--heads {heads}"
    heads = tp * -(-args.heads // tp)
    return f"--heads {heads} --d-model {heads * max(1, args.d_model // args.heads)}"


def check_layout(args, world: int, launcher: bool = False) -> None:
    """Raises ValueError naming the option, the rule and what to pass instead
    (every rank raises the same, before any collective). launcher: word the
    fix for deploy/local/launch.py (trainer options after `--`, --nproc)."""
    problem, fix = layout_problem(args, world)
    if not problem:
        return
    fits = [w for w in range(1, MAX_WORLD + 1) if not layout_problem(args, w)[0]]
    # The nearest world sizes that fit, below and above.
    fits = [w for w in (max((w for w in fits if w < world), default=None),
                        min((w for w in fits if w > world), default=None)) if w]
    world_flag = "--nproc" if launcher else "torchrun --nproc-per-node"
    options = []
    if fix:
        options.append(f"`{'-- ' if launcher else ''}{fix}`")
    if fits:
        options.append(" or ".join(f"`{world_flag} {w}`" for w in fits))
    raise ValueError(problem + (f"; pass {' or '.join(options)} instead" if options else ""))
