"""What the contract tests share: torch.optim's side of a comparison (with its
Newton-Schulz in fp32), the muond side on a Cluster, a tiny model with
deterministic data, and the comparisons.

Tolerances. muond vs muond (the same math on the same backend): bitwise.
muond vs torch.optim.Muon / torch.optim.AdamW: torch runs NS in bf16, so the
torch side runs it in fp32 (tests/client/python/torch_ns_fp32.py: its NS
function replaced by the same iteration in fp32), and muond is asked for fp32
("highest") explicitly; then the two differ by fp32 rounding
only: REL_TOL (relative, max over elements / max |value|). Every effect under
test here is orders of magnitude above it (measured 3e-2 .. 1e-1).
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import ClusterTestCase  # noqa: E402,F401  (re-exported)

from muond.torch import Muon  # noqa: E402
from tests.client.python.torch_ns_fp32 import torch_muon_ns_in_fp32  # noqa: E402

REL_TOL = 2e-5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def fp32_newton_schulz():
    """torch.optim.Muon with its NS in fp32 (see the module docstring)."""
    return torch_muon_ns_in_fp32()


class TorchReference:
    """torch.optim.Muon for the "muon" groups and torch.optim.AdamW for the
    "adamw" groups, behind one param_groups list in the order given (so a
    script indexes the same group on both sides), NS in fp32."""

    def __init__(self, groups, **muon_defaults):
        self.muon = self.adamw = None
        self.param_groups = []
        for g in groups:
            self.add_param_group(g, **muon_defaults)

    def add_param_group(self, group, **muon_defaults):
        group = dict(group)
        algorithm = group.get("algorithm", "muon")
        if algorithm == "adamw":
            if self.adamw is None:
                self.adamw = torch.optim.AdamW([group], **ADAMW)
            else:
                self.adamw.add_param_group(group)
            self.param_groups.append(self.adamw.param_groups[-1])
        else:
            if self.muon is None:
                self.muon = torch.optim.Muon([group], **{**MUON, **muon_defaults})
            else:
                self.muon.add_param_group(group)
            self.param_groups.append(self.muon.param_groups[-1])

    def optimizers(self):
        return [o for o in (self.muon, self.adamw) if o is not None]

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers():
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        with fp32_newton_schulz():
            for o in self.optimizers():
                o.step()

    def close(self):
        pass


def muond_opt(cluster, groups, **kw):
    """muond.torch.Muon over `cluster`'s daemons (split mode, 1 x N), fp32 NS."""
    kw = {**MUON, **kw}
    kw.setdefault("fp32_matmul_prec", "highest")
    kw.setdefault("rpc_timeout", 30)
    kw.setdefault("wait_healthy_timeout", 30)
    # The scenarios are one trainer at a time on the daemons' default
    # instance (a new process's first optimizer), however many optimizers
    # this test process made before.
    kw.setdefault("name", "")
    # The job's token, as the launcher gives it ($MUOND_TOKEN_FILE): a
    # takeover acts as the operator, whose client_id is derived from it.
    if cluster.token:
        kw.setdefault("token", cluster.token)
    return Muon(groups, daemons=cluster.daemons, job_id=cluster.job_id, gtp_size=1,
                tp_size=len(cluster.daemons), **kw)


def adamw_group(params, names, name="adam"):
    return {"params": params, "name": name, "param_names": names, "algorithm": "adamw", **ADAMW}


def muon_group(params, names, name="dense"):
    return {"params": params, "name": name, "param_names": names}


# -- a tiny model, deterministic data ------------------------------------------
class Tiny(torch.nn.Module):
    """Two weight matrices (Muon) and a bias (AdamW)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Parameter(torch.randn(16, 8, generator=g) * 0.3)
        self.fc2 = torch.nn.Parameter(torch.randn(4, 16, generator=g) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(4, generator=g) * 0.1)

    def forward(self, x, y=None):
        out = torch.tanh(x @ self.fc1.T) @ self.fc2.T + self.bias
        if y is None:
            return out
        return {"loss": torch.nn.functional.mse_loss(out, y)}


def tiny_groups(model):
    return [muon_group([model.fc1, model.fc2], ["fc1", "fc2"]),
            adamw_group([model.bias], ["bias"])]


def muond_tiny_opt(cluster, model, **kw):
    return muond_opt(cluster, tiny_groups(model), **kw)


def torch_tiny_opt(model):
    """The harness's sanity side: torch.optim.Muon on the weights (one
    optimizer, as HF and Lightning take one); the bias stays."""
    return torch.optim.Muon([model.fc1, model.fc2], **MUON)


def batch(step, n=4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def dataset(n=16):
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    return [{"x": xs[i], "y": ys[i]} for i in range(n)]


def train(model, opt, steps, first=1):
    for s in range(first, first + steps):
        x, y = batch(s)
        opt.zero_grad()
        model(x, y)["loss"].backward()
        opt.step()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_params(model, values):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])


# -- comparisons ---------------------------------------------------------------
def max_abs_diff(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def bitwise_mismatches(got: dict, want: dict) -> list[str]:
    out = []
    for n in want:
        if not torch.equal(got[n], want[n]):
            out.append(f"{n}: max |diff| {max_abs_diff(got[n], want[n]):.3g}")
    return out


def rel_diff(a, b):
    scale = max(float(b.double().abs().max()), 1e-12)
    return max_abs_diff(a, b) / scale


def deepcopy_params(params):
    return [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            for p in params]


__all__ = [n for n in dir() if not n.startswith("_")] + ["copy"]
