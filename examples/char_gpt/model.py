"""A small GPT (pre-LayerNorm decoder, learned positions) for characters.

Megatron-style sharding tags are stamped on the Muon matrices (megatron_tags,
the default) so that muond.torch.Muon, in single-trainer split mode (train.py),
shards them as Megatron would: q/k/v and MLP up are column-parallel
(partition_dim 0, split output rows), attention output and MLP down are
row-parallel (partition_dim 1). The torchrun trainer (train_dist.py) builds the
model without tags and shards it with PyTorch's own APIs; attention then runs on
the heads the local q/k/v rows hold (ColwiseParallel splits them by head).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4,
                 megatron_tags: bool = True):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.ln2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, mlp_ratio * d_model, bias=True)
        self.down = nn.Linear(mlp_ratio * d_model, d_model, bias=True)
        if megatron_tags:
            for lin in (self.q, self.k, self.v, self.up):
                _tag(lin.weight, partition_dim=0)
            for lin in (self.o, self.down):
                _tag(lin.weight, partition_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        # Under tensor parallelism q/k/v hold this rank's heads only.
        local_heads = q.shape[-1] // self.head_dim
        split = lambda t: t.view(B, T, local_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, local_heads * self.head_dim))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _tag(weight: nn.Parameter, partition_dim: int) -> None:
    weight.tensor_model_parallel = True
    weight.partition_dim = partition_dim


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 128,
                 n_layers: int = 4, n_heads: int = 4, megatron_tags: bool = True):
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, megatron_tags=megatron_tags)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=True)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: residual projections scaled by depth
            for lin in (block.o, block.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def param_groups(self):
        """(muon, adamw) lists of (name, param): the blocks' 2-D matrices go to
        Muon; embeddings, norms, biases and the head to AdamW."""
        muon, adamw = [], []
        for name, p in self.named_parameters():
            is_matrix = name.startswith("blocks.") and p.ndim == 2
            (muon if is_matrix else adamw).append((name, p))
        return muon, adamw

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, num_chars: int, temperature: float = 0.8,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        for _ in range(num_chars):
            logits = self(idx[:, -self.context:])[:, -1, :] / temperature
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
