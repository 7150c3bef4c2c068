"""One trainer rank of a Megatron-Core GPT on CPU under gloo (megatron_cpu):
the model with Megatron's local transformer spec, Megatron's optimizer from
``megatron.core.optimizer.get_megatron_optimizer`` (its own Muon,
TensorParallelMuon) or from ``muond.megatron.get_megatron_optimizer``, and
Megatron DDP's contract for grads: after backward each param's grad,
averaged over its DP group, is in ``param.main_grad`` and ``param.grad`` is
None (Megatron's DDP needs CUDA streams; its reduction is this one).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402,F401  (typing.override before megatron imports)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEQ, VOCAB, GLOBAL_BATCH = 32, 128, 8
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)


# The seed's options, the same for Megatron's TensorParallelMuon and muond's
# LayerShardedMuon in the tests that build both directly (fp32 NS on both
# sides: their results agree to fp32 rounding).
SEED_MUON_OPTIONS = dict(lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True,
                         fp32_matmul_prec="highest", coefficient_type="quintic",
                         num_ns_steps=5, scale_mode="spectral", extra_scale_factor=1.0,
                         tp_mode="duplicated")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def init(rank: int, world: int, port: int, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megatron_cpu.install()


def reset_parallel(tp: int) -> None:
    """Another TP size in the same processes (a checkpoint resharded)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megatron_cpu.install()


def build_model(seed: int = 1234, bf16: bool = False, vocab: int = VOCAB, seq: int = SEQ,
                **model):
    """The same full weights on every TP size: Megatron initialises the
    master weight on the CPU and keeps this rank's partition. ``bf16``:
    bf16 params under Megatron's Float16Module, as Megatron trains."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    torch.manual_seed(seed)
    cfg = TransformerConfig(**{**MODEL, **model}, use_cpu_initialization=True,
                            hidden_dropout=0.0,
                            attention_dropout=0.0, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            tensor_model_parallel_size=_tp_size())
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=vocab, max_sequence_length=seq)
    return Float16Module(cfg, model) if bf16 else model


def _tp_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_world_size()


def optimizer_config(**overrides):
    from megatron.core.optimizer import OptimizerConfig
    fields = dict(optimizer="muon", lr=0.02, weight_decay=0.01, bf16=False,
                  muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest",
                  muon_momentum=0.95, clip_grad=1.0)
    fields.update(overrides)
    return OptimizerConfig(**fields)


def batch(step: int):
    """This DP rank's slice of the global batch at ``step`` (the same on
    every TP rank): the global batch does not depend on the DP size, so a
    job resharded to another TP x DP trains on the same data."""
    from megatron.core import parallel_state
    dp, dp_size = (parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size())
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    rows = GLOBAL_BATCH // dp_size
    tokens = tokens[dp * rows:(dp + 1) * rows]
    return tokens[:, :-1], tokens[:, 1:]


def forward_backward(model, step: int, batch_of=None) -> float:
    """Forward and backward of this DP rank's batch (``batch_of(step)``,
    default ``batch``), then Megatron DDP's grad contract (module
    docstring); the loss averaged over DP."""
    from megatron.core import parallel_state
    tokens, labels = (batch_of or batch)(step)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(
        tokens.shape[0], seq)
    mask = megatron_cpu.causal_mask(seq).to(tokens.device)
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    dp_group = parallel_state.get_data_parallel_group()
    dp = dist.get_world_size(dp_group)
    for p in model.parameters():
        grad = (p.grad if p.grad is not None else torch.zeros_like(p)).float()
        dist.all_reduce(grad, group=dp_group)
        p.main_grad = grad / dp
        p.grad = None
    value = loss.detach().clone()
    dist.all_reduce(value, group=dp_group)
    return float(value) / dp


def train(model, opt, first: int, steps: int) -> list:
    """Megatron's loop: zero_grad, forward/backward, step -> (ok, norm, zeros)."""
    losses = []
    for step in range(first, first + steps):
        opt.zero_grad()
        losses.append(forward_backward(model, step))
        ok, grad_norm, _ = opt.step()
        if not ok:
            raise RuntimeError(f"step {step}: Megatron's optimizer refused the step")
        losses[-1] = (losses[-1], float(grad_norm))
    return losses


def full_params(model) -> dict:
    """Every param gathered over TP along its partition_dim (TP-replicated
    ones as they are), as CPU fp32 tensors keyed by name."""
    from megatron.core import parallel_state
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().float().contiguous()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=group)
            t = torch.cat(parts, dim=int(p.partition_dim))
        out[name] = t.clone()
    return out
