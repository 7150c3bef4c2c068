"""torch.optim.Muon with its Newton-Schulz in fp32: the reference that
muond's fp32_matmul_prec="highest" matches to fp32 rounding (the recipe
client/python/README.md gives, "An exact comparison with torch.optim.Muon").

torch runs NS on bf16 operands, cast inside its private
torch.optim._muon._zeropower_via_newtonschulz (`grad.bfloat16()` in some
versions, `grad.to(dtype=torch.bfloat16)` in others), so patching the cast
breaks with the version. Replacing the whole function with the same
iteration in fp32 does not depend on how it casts, and mock.patch.object
fails loudly if the function moves instead of silently comparing with bf16.
"""
from unittest import mock

import torch


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration, in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def torch_muon_ns_in_fp32():
    """A context in which torch.optim.Muon's steps run NS in fp32."""
    return mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz",
                             fp32_newton_schulz)
