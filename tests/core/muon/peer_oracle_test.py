"""Peer oracles for muond's CPU math, fed the same fp32 inputs:

1. Newton-Schulz for every coefficient set vs Emerging-Optimizers 0.3.0
   `newton_schulz` at "highest" fp32 matmul precision: <= 1e-5 relative
   (Frobenius). EO's default eps is 1e-7 while muond's is 1e-15; both place
   eps the same way (x / max(||x||_F, eps)), and the test passes muond's eps
   to EO explicitly, so both sides compute the same function.
2. Five Muon steps with torch.optim.Muon's settings (simple coefficients,
   eps 1e-7, `original` scale = adjust_lr_fn None, Nesterov, decoupled weight
   decay) vs torch.optim.Muon itself: <= 1e-5 relative on the params.

Adapting torch.optim.Muon to fp32 (the tolerance is never adapted):
torch/optim/_muon.py::_zeropower_via_newtonschulz starts with
`ortho_grad = grad.bfloat16()` and then runs the whole iteration in the
dtype of that tensor. The only bf16 in the math is that cast, so the test
swaps `torch.Tensor.bfloat16` for the duration of `step()` with a function
that returns an fp32 *copy* of its input. torch's own NS code (transpose,
in-place div_ by norm.clamp(min=eps), addmm with beta=b/alpha=c and beta=a)
then runs unchanged in fp32. The copy (rather than `self` itself) keeps the
in-place div_ from touching the momentum buffer, as the bf16 cast would.
Nothing else of torch is modified. Conventions that already agree: torch and
muond both use the EMA momentum (buf.lerp_(g, 1-mu); g.lerp(buf, mu)) and
x / max(||x||, eps). torch decays as p *= 1 - lr*wd then p -= lr*scale*O;
muond as p -= lr*wd*p; p -= lr*(O*scale): equal up to fp32 rounding.
"""
import os
import subprocess
import sys
import tempfile
import typing
import unittest

import numpy as np
import torch

# emerging_optimizers 0.3.0 imports typing.override (Python 3.12+).
if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override

from emerging_optimizers.orthogonalized_optimizers import muon_utils  # noqa: E402

CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "muon_cli")
COEFFICIENT_TYPES = ["simple", "quintic", "polar_express", "aol", "cans", "deepseekv4"]
CUSTOM = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_cli(*args):
    proc = subprocess.run([CLI, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"muon_cli {args} failed: {proc.stderr}")


class PeerOracleTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        torch.manual_seed(0)

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def muond_ns(self, x, ctype, steps, eps, custom=None):
        rows, cols = x.shape
        x.numpy().astype(np.float32).tofile(self.path("in.bin"))
        args = ["ns", f"rows={rows}", f"cols={cols}", f"type={ctype}", f"steps={steps}",
                f"eps={eps!r}", f"in={self.path('in.bin')}", f"out={self.path('out.bin')}"]
        if custom:
            args.append("custom=" + ";".join(",".join(repr(v) for v in t) for t in custom))
        run_cli(*args)
        return np.fromfile(self.path("out.bin"), dtype=np.float32).reshape(rows, cols)

    def test_newton_schulz_every_coefficient_set_vs_emerging_optimizers(self):
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            for ctype in COEFFICIENT_TYPES + ["custom"]:
                for shape in [(48, 80), (80, 48), (64, 64)]:
                    for steps in [5, 9]:
                        x = torch.randn(*shape, dtype=torch.float32)
                        custom = CUSTOM if ctype == "custom" else None
                        ours = self.muond_ns(x, ctype, steps, 1e-15, custom)
                        theirs = muon_utils.newton_schulz(
                            x, steps, coefficient_type=ctype,
                            custom_coefficient_sets=custom, eps=1e-15).numpy()
                        with self.subTest(ctype=ctype, shape=shape, steps=steps):
                            self.assertLessEqual(rel(ours, theirs), 1e-5)
        finally:
            torch.set_float32_matmul_precision(prev)

    def test_muon_five_steps_vs_torch_optim_muon_fp32(self):
        for shape in [(48, 32), (32, 48)]:
            rows, cols = shape
            lr, mu, wd, iters = 0.02, 0.95, 0.1, 5
            p0 = torch.randn(rows, cols, dtype=torch.float32)
            grads = torch.randn(iters, rows, cols, dtype=torch.float32)

            param = torch.nn.Parameter(p0.clone())
            opt = torch.optim.Muon([param], lr=lr, weight_decay=wd, momentum=mu,
                                   nesterov=True, eps=1e-7, ns_steps=5,
                                   adjust_lr_fn="original")
            original_bf16 = torch.Tensor.bfloat16
            torch.Tensor.bfloat16 = lambda t, *a, **k: t.to(torch.float32, copy=True)
            try:
                for t in range(iters):
                    param.grad = grads[t].clone()
                    opt.step()
            finally:
                torch.Tensor.bfloat16 = original_bf16
            theirs = param.detach().numpy()

            p0.numpy().tofile(self.path("p.bin"))
            grads.numpy().tofile(self.path("g.bin"))
            run_cli("muon", f"rows={rows}", f"cols={cols}", f"iters={iters}", f"lr={lr}",
                    f"momentum={mu}", f"wd={wd}", "nesterov=1", "type=simple", "steps=5",
                    "eps=1e-07", "scale=original", "wd_method=decoupled",
                    f"param={self.path('p.bin')}", f"grads={self.path('g.bin')}",
                    f"out={self.path('out.bin')}")
            ours = np.fromfile(self.path("out.bin"), dtype=np.float32).reshape(rows, cols)
            # The contract: params after 5 steps agree to 1e-5 relative. The
            # relative difference of the *changes* (p - p0) is printed only:
            # with |p| ~ 1 and |p - p0| ~ 3e-2, one fp32 ulp of p (6e-8) is
            # already ~2e-6 of the change, and torch (p *= 1 - lr*wd) and
            # muond (p -= lr*wd*p) round in different places every step.
            delta = rel(ours - p0.numpy(), theirs - p0.numpy())
            print(f"muon {shape}: params rel {rel(ours, theirs):.3g}, changes rel {delta:.3g}")
            with self.subTest(shape=shape):
                self.assertLessEqual(rel(ours, theirs), 1e-5)
                self.assertLessEqual(delta, 1e-4)
            # The adaptation really ran fp32: bf16 NS is far outside 1e-5.
            param_bf = torch.nn.Parameter(p0.clone())
            opt_bf = torch.optim.Muon([param_bf], lr=lr, weight_decay=wd, momentum=mu,
                                      nesterov=True, eps=1e-7, adjust_lr_fn="original")
            for t in range(iters):
                param_bf.grad = grads[t].clone()
                opt_bf.step()
            self.assertGreater(rel(ours - p0.numpy(), param_bf.detach().numpy() - p0.numpy()),
                               1e-4)


if __name__ == "__main__":
    unittest.main()
