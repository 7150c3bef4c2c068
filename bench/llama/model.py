"""A Llama-style decoder for the training-step benchmark (bench/llama_train_bench.py).

RMSNorm, rotary position embeddings, grouped-query attention (q/k/v/o, no
biases), a SwiGLU MLP (gate/up/down), untied embedding and head. The block's
linear layers sit directly on the block (block.q, block.gate, ...) so that a
tensor-parallel plan names them as examples/char_gpt's does: under
ColwiseParallel q/k/v hold this rank's heads only, and attention runs on those
(the GQA grouping stays intact when the kv heads divide by the TP size: q head
i reads kv head i // (heads / kv_heads), and the local q and kv chunks line up).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def param_counts(self) -> dict[str, int]:
        """Params in total, in the blocks' matrices (the Muon set), elsewhere."""
        kv = self.kv_heads * self.head_dim
        block = (2 * self.d_model * self.d_model + 2 * kv * self.d_model
                 + 3 * self.d_model * self.ffn)
        matrices = self.layers * block
        others = 2 * self.vocab * self.d_model + (2 * self.layers + 1) * self.d_model
        return {"total": matrices + others, "block_matrices": matrices, "others": others}


PRESETS = {
    # Llama-3.2-1B's shape (untied here: ~1.24B + the separate head).
    "1b": LlamaConfig(d_model=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    # Small enough for a CPU test with 2-4 ranks on 2 cores.
    "tiny": LlamaConfig(d_model=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256),
}


def rope_tables(seq: int, head_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                          / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()  # (seq, head_dim / 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); rotates the (first half, second half) pairs (HF Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.attn_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv, bias=False)
        self.v = nn.Linear(d, kv, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.gate = nn.Linear(d, cfg.ffn, bias=False)
        self.up = nn.Linear(d, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        # Under tensor parallelism q/k/v hold this rank's heads only.
        heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim

        def split(t, n):
            return t.view(B, T, n, self.head_dim).transpose(1, 2)
        q, k, v = split(q, heads), split(k, kv_heads), split(v, kv_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA by repeating kv heads: every SDPA backend (flash included) takes it.
        rep = heads // kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:  # residual projections scaled by depth (GPT-2)
            for lin in (block.o, block.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(idx.shape[1], self.cfg.head_dim, self.cfg.rope_theta,
                               idx.device)
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def param_groups(self):
        """(muon, adamw) lists of (name, param): the blocks' 2-D matrices go to
        Muon; embedding, norms and head to AdamW (examples/char_gpt's rule, which
        train_dist.build_optimizer reads)."""
        muon, adamw = [], []
        for name, p in self.named_parameters():
            is_matrix = name.startswith("blocks.") and p.ndim == 2
            (muon if is_matrix else adamw).append((name, p))
        return muon, adamw


def tp_plan():
    """Megatron's split of a Llama block: q/k/v and the MLP's gate/up split
    output rows (ColwiseParallel), o and down split input columns
    (RowwiseParallel): examples/char_gpt's plan plus gate."""
    from torch.distributed.tensor.parallel import ColwiseParallel
    import train_dist  # examples/char_gpt (the caller puts it on sys.path)
    return {**train_dist.tp_plan(), "gate": ColwiseParallel()}
