"""NorMuon and AdaMuon in float64, written from their sources as the
independent reference of muond's variants: torch.optim.Muon's momentum,
Nesterov, Newton-Schulz (the "simple" coefficients, eps-normalised input,
the short side's Gram) and "original" scale, with between NS and the scale

* NorMuon, dion/normuon.py ``_normuon_normalization_core``: per row
  ``V <- lerp(V, mean_j U_ij^2, 1 - beta2)``, ``U <- U / (sqrt(V) + eps)``,
  ``U <- U * ||U_before||_F / clamp(||U||_F, min=eps)``; state
  ``variance_neuron`` of shape (rows, 1).
* AdaMuon, Emerging-Optimizers adaptive_muon.py (moment2_method "adamuon"):
  ``moment2 <- lerp(moment2, U^2, 1 - beta2)``, ``U <- U / (sqrt(moment2) +
  eps)``; state ``moment2_buffer`` of the param's shape.

Weight decay is torch.optim.Muon's decoupled ``p *= 1 - lr * wd``. A param
whose grad is None is skipped (no state change)."""
from __future__ import annotations

import math

import torch

SIMPLE = (3.4445, -4.775, 2.0315)


def newton_schulz(g, steps=5, eps=1e-7):
    a, b, c = SIMPLE
    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def normuon(u, v, beta2, eps):
    norm_u = u.norm()
    v = torch.lerp(v, (u * u).mean(dim=-1, keepdim=True), 1 - beta2)
    out = u / (v.sqrt() + eps)
    return out * (norm_u / out.norm().clamp(min=eps)), v


def adamuon(u, m2, beta2, eps):
    m2 = torch.lerp(m2, u * u, 1 - beta2)
    return u / (m2.sqrt() + eps), m2


class Reference:
    """One param group of 2-D params, float64."""

    def __init__(self, params, variant, lr, weight_decay, momentum, beta2=0.95, eps=1e-8):
        self.params = [p.detach().double().clone() for p in params]
        self.variant, self.lr, self.wd, self.mu = variant, lr, weight_decay, momentum
        self.beta2, self.eps = beta2, eps
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.second = [torch.zeros(p.shape[0], 1, dtype=torch.float64) if variant == "normuon"
                       else torch.zeros_like(p) for p in self.params]

    def step(self, grads):
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            buf = self.momentum[i]
            buf.lerp_(g.double(), 1 - self.mu)
            u = newton_schulz(g.double().lerp(buf, self.mu))
            rule = normuon if self.variant == "normuon" else adamuon
            u, self.second[i] = rule(u, self.second[i], self.beta2, self.eps)
            rows, cols = p.shape
            adjusted = self.lr * math.sqrt(max(1.0, rows / cols))
            p.mul_(1 - self.lr * self.wd).add_(u, alpha=-adjusted)
