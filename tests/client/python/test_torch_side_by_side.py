"""muond.torch.Muon on real daemons (coordinator + 2 host daemons, 2x1 split)
side by side with torch.optim.Muon / torch.optim.AdamW in this process, fed
the same gradients: torch.optim's grad-None rule, requires_grad=False, and
live hyperparameters (momentum warm-up, OneCycleLR cycling AdamW's betas).

Both sides run Newton-Schulz in fp32 so the comparison is tight: muond with
fp32_matmul_prec="highest", torch by swapping torch.Tensor.bfloat16 for an
fp32 copy during its step (tests/core/muon/peer_oracle_test.py explains why
that is torch's only bf16). What remains is fp32 rounding (~1e-6).
"""
import contextlib
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract"))
from cluster import Cluster  # noqa: E402  (the Python tests' one cluster fixture)
from muond.torch import Muon  # noqa: E402

TOL = 1e-5  # max relative param difference (fp32 rounding of two implementations)
LR, WD, MOMENTUM = 0.02, 0.1, 0.95


@contextlib.contextmanager
def torch_ns_in_fp32():
    original = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda t, *a, **k: t.to(torch.float32, copy=True)
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


def rel(a, b):
    return float((a - b).norm() / b.norm())


def twins(*shapes, seed=0):
    """Two lists of identical fresh params."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) for s in shapes]
    return ([torch.nn.Parameter(v.clone()) for v in values],
            [torch.nn.Parameter(v.clone()) for v in values])


class TorchSideBySideTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = Cluster(2, token=False, comm_timeout_s=20).start()
        cls.daemons, cls.job = cls.cluster.daemons, cls.cluster.job_id

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def muond(self, params, **kw):
        opt = Muon(params, daemons=self.daemons, job_id=self.job, gtp_size=2, tp_size=1,
                   fp32_matmul_prec="highest", rpc_timeout=30, **kw)
        self.addCleanup(opt.close)
        return opt

    def step_both(self, pairs, grads):
        """One step of each (optimizer, params) pair with `grads` (None: no grad)."""
        for opt, params in pairs:
            opt.zero_grad()
            for p, g in zip(params, grads):
                if g is not None:
                    p.grad = g.clone()
            with torch_ns_in_fp32():
                opt.step()

    def assert_close(self, ours, theirs, what):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            self.assertLess(rel(a.detach(), b.detach()), TOL, f"{what}: param {i}")

    def test_grad_none_and_frozen_params_as_torch_optim_muon(self):
        # w0 gets a grad every step; w1 only at steps 1 and 5 (its momentum
        # must wait untouched in between); w2 never requires grad.
        theirs, ours = twins((16, 12), (12, 16), (8, 6), seed=1)
        for p in (theirs[2], ours[2]):
            p.requires_grad_(False)
        frozen = ours[2].detach().clone()
        torch_opt = torch.optim.Muon(theirs, lr=LR, weight_decay=WD, momentum=MOMENTUM)
        opt = self.muond(ours, lr=LR, weight_decay=WD, momentum=MOMENTUM)
        g = torch.Generator().manual_seed(2)
        for step in range(1, 6):
            grads = [torch.randn(p.shape, generator=g) for p in ours]
            grads[1] = grads[1] if step in (1, 5) else None
            grads[2] = None
            before = ours[1].detach().clone()
            self.step_both([(torch_opt, theirs), (opt, ours)], grads)
            if grads[1] is None:  # skipped: exactly as torch leaves it
                self.assertTrue(torch.equal(ours[1].detach(), before), f"step {step}")
            self.assert_close(ours, theirs, f"step {step}")
        self.assertTrue(torch.equal(ours[2].detach(), frozen))
        self.assertTrue(torch.equal(theirs[2].detach(), frozen))

    def test_momentum_warmup_as_torch_optim_muon(self):
        theirs, ours = twins((16, 12), (12, 16), seed=3)
        torch_opt = torch.optim.Muon(theirs, lr=LR, weight_decay=WD, momentum=0.85)
        opt = self.muond(ours, lr=LR, weight_decay=WD, momentum=0.85)
        g = torch.Generator().manual_seed(4)
        for step in range(5):
            for o in (torch_opt, opt):
                o.param_groups[0]["momentum"] = min(0.95, 0.85 + 0.03 * step)
                o.param_groups[0]["nesterov"] = step != 3
            self.step_both([(torch_opt, theirs), (opt, ours)],
                           [torch.randn(p.shape, generator=g) for p in ours])
            self.assert_close(ours, theirs, f"step {step}")
        # A registration-time entry cannot change per step: refused, naming
        # the group and the key, before any daemon is asked.
        opt.param_groups[0]["ns_steps"] = 6
        for p in ours:
            p.grad = torch.ones_like(p)
        step_id = opt.step_id
        with self.assertRaisesRegex(ValueError, r"param group 0 .*'ns_steps' changed"):
            opt.step()
        self.assertEqual(opt.step_id, step_id)

    def test_one_cycle_lr_cycles_betas_as_torch_optim_adamw(self):
        # grad None on the bias at steps 2-3: its step count (bias
        # correction) lags the weight's, as in torch.optim.AdamW.
        theirs, ours = twins((10, 4), (10,), seed=5)
        hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
        torch_opt = torch.optim.AdamW(theirs, **hyper)
        opt = self.muond([{"params": ours, "algorithm": "adamw", **hyper}])
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8,
                                                      cycle_momentum=True)
                  for o in (torch_opt, opt)]
        g = torch.Generator().manual_seed(6)
        betas = []
        for step in range(1, 7):
            grads = [torch.randn(p.shape, generator=g) for p in ours]
            grads[1] = None if step in (2, 3) else grads[1]
            self.step_both([(torch_opt, theirs), (opt, ours)], grads)
            for s in scheds:
                s.step()
            betas.append(opt.param_groups[0]["betas"][0])
            self.assert_close(ours, theirs, f"step {step}")
        self.assertGreater(max(betas) - min(betas), 0.01)  # the scheduler did cycle them


if __name__ == "__main__":
    unittest.main()
