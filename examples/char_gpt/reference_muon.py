"""In-process reference Muon (+ AdamW) written plainly in PyTorch.

This is the numerical reference the muond daemons are compared against: the
same formulas as muond's core/muon (docs/ARCHITECTURE.md "One step", constants as
core/muon/coefficients.h holds them), one param at a time, no sharding,
no batching, fp32 Newton–Schulz.

Per Muon param and step (group keys in brackets):
  buf.lerp_(grad, 1 - momentum)                       EMA momentum
  x = grad.lerp(buf, momentum) if nesterov else buf   NS input
  orth = newton_schulz(x)                              fp32, see below
  update = orth * scale * extra_scale_factor          scale from [scale_mode]
  p -= lr * weight_decay * p                          decoupled weight decay
  p -= lr * update

Groups with ``"algorithm": "adamw"`` take a plain AdamW step with
torch.optim.AdamW semantics (decoupled weight decay p *= 1 - lr*wd, bias
corrected moments, eps added outside the square root).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

# (a, b, c) per NS iteration; cycled over the steps (Emerging-Optimizers
# muon_utils._COEFFICIENT_SETS, rounded to fp32 there too).
COEFFICIENT_SETS: dict[str, list[tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
}

SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")


def coefficients(coefficient_type: str,
                 custom: Sequence[float] | None = None) -> list[tuple[float, float, float]]:
    if coefficient_type == "custom":
        if not custom or len(custom) % 3:
            raise ValueError("custom coefficients must be a non-empty flat list a0,b0,c0,...")
        return [tuple(custom[i:i + 3]) for i in range(0, len(custom), 3)]
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"coefficient_type {coefficient_type!r} not in "
                         f"{sorted(COEFFICIENT_SETS)} or 'custom'")
    return COEFFICIENT_SETS[coefficient_type]


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficient_type: str = "quintic",
                  eps: float = 1e-15, custom: Sequence[float] | None = None) -> torch.Tensor:
    """Approximate orthogonal factor of a 2-D matrix, computed in fp32.

    X = G / max(||G||_F, eps); transposed when rows > cols so that the Gram
    matrix A = X X^T is min(rows, cols)^2; per step with (a, b, c):
    B = b A + c A A, X = a X + B X.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    coeffs = coefficients(coefficient_type, custom)
    x = g.to(torch.float32)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / x.norm().clamp_min(eps)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    if transpose:
        x = x.T
    return x


def scale_factor(rows: int, cols: int, scale_mode: str = "spectral") -> float:
    if scale_mode == "spectral":
        return math.sqrt(max(rows, cols))
    if scale_mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if scale_mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"scale_mode {scale_mode!r} not in {SCALE_MODES}")


def muon_update(grad: torch.Tensor, buf: torch.Tensor, *, momentum: float, nesterov: bool,
                ns_steps: int, coefficient_type: str, eps: float, scale_mode: str,
                extra_scale_factor: float, custom: Sequence[float] | None = None) -> torch.Tensor:
    """Updates ``buf`` in place and returns the scaled orthogonal update."""
    buf.lerp_(grad, 1 - momentum)
    x = grad.lerp(buf, momentum) if nesterov else buf
    orth = newton_schulz(x, ns_steps, coefficient_type, eps, custom)
    return orth * scale_factor(grad.shape[0], grad.shape[1], scale_mode) * extra_scale_factor


def apply_muon(p: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then the update, in place."""
    p.sub_(lr * weight_decay * p)
    p.sub_(lr * update)


def adamw_step(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               step: int, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """One AdamW step in place (torch.optim.AdamW, single-tensor, non-amsgrad)."""
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class ReferenceMuon(torch.optim.Optimizer):
    """Muon for 2-D params plus AdamW for groups with ``algorithm="adamw"``.

    Hyperparameter names follow muond.torch.Muon so the same param groups
    can be given to either. Muon params must be 2-D.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 eps: float = 1e-15, *, coefficient_type: str = "quintic",
                 custom_coefficients: Sequence[float] | None = None,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, eps=eps, coefficient_type=coefficient_type,
                        custom_coefficients=custom_coefficients, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, algorithm="muon", betas=betas)
        params = list(params)
        if params and isinstance(params[0], dict):
            for group in params:
                if group.get("algorithm", "muon") == "adamw":
                    group.setdefault("eps", adamw_eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"algorithm {group['algorithm']!r} not in ('muon', 'adamw')")
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    if p.ndim != 2:
                        raise ValueError(f"Muon params must be 2-D, got shape {tuple(p.shape)}; "
                                         "put it in an algorithm='adamw' group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["algorithm"] == "muon":
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                    update = muon_update(
                        p.grad.float(), state["momentum_buffer"], momentum=group["momentum"],
                        nesterov=group["nesterov"], ns_steps=group["ns_steps"],
                        coefficient_type=group["coefficient_type"], eps=group["eps"],
                        scale_mode=group["scale_mode"],
                        extra_scale_factor=group["extra_scale_factor"],
                        custom=group["custom_coefficients"])
                    apply_muon(p, update, group["lr"], group["weight_decay"])
                else:
                    if not state:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] += 1
                    beta1, beta2 = group["betas"]
                    adamw_step(p, p.grad.float(), state["exp_avg"], state["exp_avg_sq"],
                               state["step"], lr=group["lr"], beta1=beta1, beta2=beta2,
                               eps=group["eps"], weight_decay=group["weight_decay"])
        return loss
