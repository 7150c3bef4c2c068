"""QK-clip written from the Kimi K2 report, on full weights, for the tests:
one loop per head in float64, no muond code.

For head h with maximum logit S_h over the batch and threshold tau, when
S_h > tau: gamma_h = tau / S_h, W_q^h *= gamma_h ** alpha and W_k^h *=
gamma_h ** (1 - alpha). A key head shared by several query heads (GQA) takes
the gamma of the largest maximum among them (Megatron-LM's grouped rule).
MLA: no-RoPE query rows * gamma ** alpha, RoPE query rows * gamma, no-RoPE
key rows * gamma ** (1 - alpha), values and the shared RoPE key untouched.
"""
from __future__ import annotations

import torch


def gamma(s: float, tau: float) -> float:
    return tau / s if s > tau else 1.0


def clip_separate(wq, wk, maxima, tau, alpha, num_heads, num_kv_heads, head_dim):
    """New (wq, wk) (float64 math, cast back to the weights' dtype)."""
    q, k = wq.double().clone(), wk.double().clone()
    per = num_heads // num_kv_heads
    s = [float(x) for x in maxima]
    for h in range(num_heads):
        q[h * head_dim:(h + 1) * head_dim] *= gamma(s[h], tau) ** alpha
    for j in range(num_kv_heads):
        g = gamma(max(s[j * per:(j + 1) * per]), tau)
        k[j * head_dim:(j + 1) * head_dim] *= g ** (1 - alpha)
    return q.to(wq.dtype), k.to(wk.dtype)


def clip_fused(wqkv, maxima, tau, alpha, num_heads, num_kv_heads, head_dim):
    """Megatron's linear_qkv: per query group its query heads, key, value."""
    w = wqkv.double().clone()
    per = num_heads // num_kv_heads
    block = (per + 2) * head_dim
    s = [float(x) for x in maxima]
    for j in range(num_kv_heads):
        base = j * block
        for i in range(per):
            h = j * per + i
            w[base + i * head_dim:base + (i + 1) * head_dim] *= gamma(s[h], tau) ** alpha
        g = gamma(max(s[j * per:(j + 1) * per]), tau)
        w[base + per * head_dim:base + (per + 1) * head_dim] *= g ** (1 - alpha)
    return w.to(wqkv.dtype)


def clip_mla(wq, wkv, maxima, tau, alpha, num_heads, nope, rope, v):
    q, kv = wq.double().clone(), wkv.double().clone()
    for h in range(num_heads):
        g = gamma(float(maxima[h]), tau)
        q[h * (nope + rope):h * (nope + rope) + nope] *= g ** alpha
        q[h * (nope + rope) + nope:(h + 1) * (nope + rope)] *= g
        kv[h * (nope + v):h * (nope + v) + nope] *= g ** (1 - alpha)
    return q.to(wq.dtype), kv.to(wkv.dtype)
