"""A Megatron-Core GPT (local transformer spec) trained with Megatron's own
Muon and with ``muond.megatron`` from the same init and the same data, side
by side in one job: loss curves and optimizer step times.

Each trainer rank trains the reference first, then muond's, both through
Megatron's optimizer factory (``megatron.core.optimizer`` vs
``muond.megatron``: the one-line change), on the char-GPT fortunes corpus
(examples/char_gpt/data.py), with Megatron DDP's grad contract (grads
averaged over DP in ``main_grad``; tests/megatron/megatron_trainer.py).
The reference is Megatron-Core's TensorParallelMuon (the parent of
Megatron-LM's LayerShardedMuon) with ``--tp-mode`` (default "duplicated":
full-matrix NS, the update LayerShardedMuon computes). With
``--megatron-lm CHECKOUT`` (a Megatron-LM checkout with layer-sharded Muon)
Megatron-LM's own LayerShardedMuon runs too, through the same factory, its NS
homes spread over the TP group (tests/megatron/megatron_lm/megatron_lm_muon.py).

CPU, TP 2 x DP 2 under gloo (Megatron's CUDA-only spots redirected by
tests/megatron/megatron_cpu.py):

    muond launch --nproc-per-node 4 --device cpu -- python -m torch.distributed.run \\
        --standalone --nproc-per-node 4 bench/megatron_train_bench.py --steps 200 \\
        --out out/megatron_bench

On GPUs (NCCL, bf16 params): ``--device cuda --bf16`` and one rank per GPU.
Rank 0 prints a markdown table and writes ``curves.json`` under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(_REPO, "tests", "megatron"))
sys.path.insert(0, os.path.join(_REPO, "tests", "megatron", "megatron_lm"))
sys.path.insert(0, os.path.join(_REPO, "examples", "char_gpt"))
import megatron_cpu  # noqa: E402  (typing.override before megatron imports)
import megatron_trainer as mt  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from data import load_corpus, sample_starts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 params (Float16Module)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--tp-mode", default="duplicated")
    p.add_argument("--fp32-matmul-prec", default="highest")
    p.add_argument("--out", default="out/megatron_bench")
    p.add_argument("--no-split-qkv", action="store_true",
                   help="muon_split_qkv=False: orthogonalize QKV whole (Megatron's default splits)")
    p.add_argument("--megatron-lm", metavar="CHECKOUT",
                   help="also run Megatron-LM's own LayerShardedMuon from this checkout")
    return p.parse_args(argv)


def init(args) -> None:
    from megatron.core import parallel_state
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if args.device == "cpu":
        megatron_cpu.install()
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)


def batches(args, corpus):
    """step -> this DP rank's slice of the step's global batch (the same
    global batch on any TP x DP)."""
    from megatron.core import parallel_state
    dp, dp_size = (parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size())
    rows = args.global_batch // dp_size

    def batch_of(step):
        g = torch.Generator().manual_seed(1000 + step)
        starts = sample_starts(g, len(corpus.train), args.global_batch, args.seq)
        idx = starts[dp * rows:(dp + 1) * rows, None] + torch.arange(args.seq + 1)[None]
        chunk = corpus.train[idx].to(args.device)
        return chunk[:, :-1], chunk[:, 1:]
    return batch_of


def train(args, kind: str, batch_of) -> dict:
    """``kind``: "megatron", "megatron-lsm" (Megatron-LM's LayerShardedMuon),
    "muond", or "megatron+1ulp" (Megatron's own
    Muon from the init scaled by 1 + 2^-23 (bf16: 2^-7), every param one
    rounding step off: how far rounding alone moves the curve, the noise
    floor muond's difference is read against)."""
    model = mt.build_model(bf16=args.bf16, vocab=128, seq=args.seq, num_layers=args.layers,
                           hidden_size=args.hidden, num_attention_heads=args.heads,
                           ffn_hidden_size=4 * args.hidden)
    model = model.to(args.device)
    if kind == "megatron+1ulp":
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + (2.0 ** -7 if args.bf16 else 2.0 ** -23))
    config = mt.optimizer_config(lr=args.lr, bf16=args.bf16, muon_tp_mode=args.tp_mode,
                                 muon_fp32_matmul_prec=args.fp32_matmul_prec,
                                 muon_split_qkv=not args.no_split_qkv)
    if kind == "muond":
        from muond.megatron import get_megatron_optimizer
    else:
        from megatron.core.optimizer import get_megatron_optimizer
    if kind == "megatron-lsm":
        import megatron_lm_muon
        with megatron_lm_muon.installed(args.megatron_lm):
            opt = get_megatron_optimizer(config, [model])
        if megatron_lm_muon.assign_ns_homes(opt) == 0:
            raise RuntimeError("megatron-lsm: no LayerShardedMuon in the optimizer")
    else:
        opt = get_megatron_optimizer(config, [model])
    losses, step_ms = [], []
    for step in range(args.steps):
        opt.zero_grad()
        losses.append(mt.forward_backward(model, step, batch_of))
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok, _, _ = opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if not ok:
            raise RuntimeError(f"{kind}: step {step} refused")
    for part in opt.chained_optimizers:
        close = getattr(part.optimizer, "close", None)
        if close is not None:
            close()
    return {"loss": losses, "step_ms": step_ms}


def table(args, runs: dict) -> str:
    ref, got, floor = runs["megatron"], runs["muond"], runs["megatron+1ulp"]
    skip = min(5, args.steps // 4)  # warm-up: first steps register, plan, compile
    med = {k: statistics.median(r["step_ms"][skip:]) for k, r in runs.items()}
    diff = lambda run: max(abs(a - b) for a, b in zip(ref["loss"], run["loss"]))  # noqa: E731
    tail = max(1, args.steps // 10)
    last = {k: sum(r["loss"][-tail:]) / tail for k, r in runs.items()}
    dp = dist.get_world_size() // args.tp
    lines = [
        f"Megatron-Core GPT ({args.layers} layers, hidden {args.hidden}, seq {args.seq}), "
        f"TP {args.tp} x DP {dp}, {args.device}, {'bf16' if args.bf16 else 'fp32'} params, "
        f"{args.steps} steps, lr {args.lr}, muon_tp_mode={args.tp_mode}, "
        f"fp32_matmul_prec={args.fp32_matmul_prec}", "",
        "| optimizer | first loss | mean loss, last {} steps | optimizer step ms "
        "(median) |".format(tail),
        "| --- | --- | --- | --- |",
        f"| Megatron's Muon (TensorParallelMuon) | {ref['loss'][0]:.4f} | "
        f"{last['megatron']:.4f} | {med['megatron']:.2f} |",
        *([f"| Megatron-LM's LayerShardedMuon | {runs['megatron-lsm']['loss'][0]:.4f} | "
            f"{last['megatron-lsm']:.4f} | {med['megatron-lsm']:.2f} |"]
          if "megatron-lsm" in runs else []),
        f"| muond.megatron | {got['loss'][0]:.4f} | {last['muond']:.4f} | "
        f"{med['muond']:.2f} |",
        f"| Megatron's Muon from the init one rounding step off (noise floor) | "
        f"{floor['loss'][0]:.4f} | {last['megatron+1ulp']:.4f} | "
        f"{med['megatron+1ulp']:.2f} |", "",
        f"max |loss difference| from Megatron's over the {args.steps} steps: muond "
        f"{diff(got):.2e}, noise floor {diff(floor):.2e}; optimizer step time muond / "
        f"Megatron: {med['muond'] / med['megatron']:.2f}",
    ]
    if "megatron-lsm" in runs:
        lsm = runs["megatron-lsm"]
        lines.append(
            f"Megatron-LM's LayerShardedMuon: max |loss difference| from Megatron's "
            f"TensorParallelMuon {diff(lsm):.2e}; muond's from it "
            f"{max(abs(a - b) for a, b in zip(lsm['loss'], got['loss'])):.2e}; "
            f"optimizer step time muond / LayerShardedMuon: "
            f"{med['muond'] / med['megatron-lsm']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    init(args)
    corpus = load_corpus()
    batch_of = batches(args, corpus)
    kinds = ("megatron",) + (("megatron-lsm",) if args.megatron_lm else ()) + (
        "muond", "megatron+1ulp")
    runs = {kind: train(args, kind, batch_of) for kind in kinds}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "curves.json"), "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f)
        print(table(args, runs), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
