"""The three optimizers bench/llama_train_bench.py races, built from its options with
the same math: muond.torch.Muon (as examples/char_gpt/train_dist.py builds it),
torch.optim.Muon in every process on full replicas of sharded matrices, and muonium
0.2.0; and the group values each one holds (bench/README.md "The whole training
step")."""
from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

ADAMW_EPS = 1e-8
# Newton-Schulz's normalisation eps, X / (||X|| + eps): torch.optim.Muon's and
# muonium's default, passed to muond too (train_dist.build_optimizer's own is
# 1e-15, the char-GPT reference's).
NS_EPS = 1e-7


def import_muonium(args):
    if args.muonium_path and args.muonium_path not in sys.path:
        sys.path.insert(0, args.muonium_path)
    import muonium
    return muonium


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def build_muond(model, args):
    """train_dist.build_optimizer with torch.optim.Muon's math (simple
    coefficients, `original` = shape_scaling x 1 lr scale)."""
    import train_dist
    ns = SimpleNamespace(lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum,
                         ns_steps=args.ns_steps, adamw_lr=args.adamw_lr, betas=args.betas,
                         adamw_weight_decay=args.adamw_weight_decay,
                         coefficient_type="simple", scale_mode="shape_scaling",
                         extra_scale_factor=1.0, fp32_matmul_prec=args.muond_ns_precision,
                         ns_algorithm="auto", gram_dtype="fp16", gram_restarts=None,
                         state_dtype=args.muond_state_dtype,
                         state_location=args.muond_state_location,
                         ns_batch_size=args.muond_ns_batch_size,
                         wait_healthy=args.wait_healthy)
    return train_dist.build_optimizer(model, ns, eps=NS_EPS)


@contextlib.contextmanager
def fp32_newton_schulz():
    """torch.optim.Muon with its NS in fp32: its one bf16 cast (grad.bfloat16()
    in _zeropower_via_newtonschulz) returns an fp32 copy instead, as
    tests/client/python/contract/common.py runs it."""
    import torch
    original = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda t, *a, **k: t.to(torch.float32, copy=True)
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


class RedundantTorchMuon:
    """torch.optim.Muon in every process, as a user runs it on a sharded model
    today: every rank orthogonalizes every matrix."""

    def __init__(self, model, args):
        import torch
        from torch.distributed.tensor import DTensor
        muon, adamw = unwrap(model).param_groups()
        self.params = [p for _, p in muon + adamw]
        self.sharded = []  # (DTensor param, its full plain replica)
        plain = []
        for _, p in muon:  # the same order on every rank: full_tensor is a collective
            if isinstance(p, DTensor):
                replica = torch.nn.Parameter(p.full_tensor().detach().clone())
                self.sharded.append((p, replica))
                plain.append(replica)
            else:
                plain.append(p)
        self.muon = torch.optim.Muon(plain, lr=args.lr, weight_decay=args.weight_decay,
                                     momentum=args.momentum, nesterov=True,
                                     ns_steps=args.ns_steps, eps=NS_EPS,
                                     adjust_lr_fn="original")
        self.adamw = torch.optim.AdamW([p for _, p in adamw], lr=args.adamw_lr,
                                       betas=tuple(args.betas), eps=ADAMW_EPS,
                                       weight_decay=args.adamw_weight_decay)
        self.fp32_ns = args.torch_ns_precision == "fp32"

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        for _, replica in self.sharded:
            replica.grad = None

    def step(self):
        import torch
        from torch.distributed.tensor import DTensor, Replicate
        with torch.no_grad():
            for p, replica in self.sharded:
                replica.grad = p.grad.full_tensor()
            with fp32_newton_schulz() if self.fp32_ns else contextlib.nullcontext():
                self.muon.step()
            self.adamw.step()
            for p, replica in self.sharded:
                mesh = p.device_mesh
                full = DTensor.from_local(replica.detach(), mesh, [Replicate()] * mesh.ndim,
                                          run_check=False)
                # Replicate -> the param's placements: each rank keeps its chunk.
                p.to_local().copy_(full.redistribute(mesh, p.placements).to_local())

    def close(self):
        pass


def build_muonium(model, args):
    muonium = import_muonium(args)
    muon, adamw = unwrap(model).param_groups()
    return muonium.Muon(
        [{"params": [p for _, p in muon]},  # "muon" is the default algorithm
         {"params": [p for _, p in adamw], "algorithm": "adamw", "lr": args.adamw_lr,
          "wd": args.adamw_weight_decay}],
        lr=args.lr, wd=args.weight_decay, use_cautious_wd=False, momentum=args.momentum,
        nesterov=True, ns_steps=args.ns_steps, orthogonalization_strategy="newton_schulz",
        adam_betas=tuple(args.betas), adam_eps=ADAMW_EPS, is_adamw=True)


def optimizer_notes(args) -> dict[str, str]:
    prec = {"medium": "bf16", "high": "TF32", "highest": "fp32"}[args.muond_ns_precision]
    return {
        "muond": f"muond.torch.Muon, {prec} NS (fp32_matmul_prec={args.muond_ns_precision}), "
                 "layer-sharded over the job's daemons; AdamW in the daemons; state "
                 f"{args.muond_state_dtype} on the {args.muond_state_location}",
        "torch": f"torch.optim.Muon ({args.torch_ns_precision} NS) in every process on full "
                 "replicas of sharded matrices (grads gathered by full_tensor); torch.optim.AdamW",
        "muonium": "muonium.Muon 0.2.0, newton_schulz (bf16, Triton Gram kernel, "
                   "torch.compile), plain wd; its own differences: momentum M = mu M + G "
                   "(torch: EMA, equal after NS's normalisation), weight decay scaled by "
                   "lr x the shape ratio (torch: by lr)",
    }


MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "eps")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def hyperparameters(opt) -> dict:
    """The Muon and AdamW groups' values as the built optimizer holds them (the
    first group of each kind; muonium names weight decay `wd` and has no NS eps
    in its groups: its Newton-Schulz fixes 1e-7)."""
    if isinstance(opt, RedundantTorchMuon):
        groups = [("muon", opt.muon.param_groups[0]), ("adamw", opt.adamw.param_groups[0])]
    else:  # muond: "algorithm"; muonium: "use_muon" (and "algorithm")
        groups = [("adamw" if g.get("algorithm") in ("adamw", "adam")
                   or g.get("use_muon") is False else "muon", g) for g in opt.param_groups]

    def plain(v):
        if hasattr(v, "item"):  # muonium keeps lr as a tensor
            return v.item()
        return list(v) if isinstance(v, tuple) else v
    out = {}
    for kind, g in groups:
        if kind not in out:
            keys = MUON_KEYS if kind == "muon" else ADAMW_KEYS
            g = {("weight_decay" if k == "wd" else k): v for k, v in g.items()}
            out[kind] = {k: plain(g[k]) for k in keys if k in g}
    return out
