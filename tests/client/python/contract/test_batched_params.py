"""Muon params of more than two dims on real host daemons: an [E, m, n]
param (experts) is E independent matrices. Against two independent
references: the same matrices given as E separate 2-D params to muond
(bitwise: the same math on the same backend) and to torch.optim.Muon (NS in
fp32, within REL_TOL); its state in torch.optim's format at the param's
shape, resumed bitwise; grad None leaves it alone; bad params named."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (REL_TOL, ClusterTestCase, TorchReference, muon_group,  # noqa: E402
                    muond_opt, rel_diff)

STEPS = 3
SHAPE = (5, 12, 20)  # 5 experts of 12 x 20
DEEP = (2, 3, 8, 6)  # a 2 x 3 batch of 8 x 6 matrices


def initial(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.3


def grad(shape, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(shape, generator=g)


def matrices(t):
    return t.reshape(-1, *t.shape[-2:])


class BatchedParamsTest(ClusterTestCase):
    NUM_DAEMONS = 2  # split mode: the experts spread over both daemons

    def run_batched(self, shape, steps=STEPS, **kw):
        """(the batched param after ``steps``, its optimizer's state dict)."""
        p = torch.nn.Parameter(initial(shape))
        opt = muond_opt(self.cluster, [muon_group([p], ["experts"])], **kw)
        try:
            for step in range(steps):
                p.grad = grad(shape, step)
                opt.step()
            return p.detach().clone(), opt.state_dict()
        finally:
            opt.close()

    def run_separate(self, shape, **kw):
        """Each matrix of the batched param as a 2-D param of its own."""
        ps = [torch.nn.Parameter(m.clone()) for m in matrices(initial(shape))]
        opt = muond_opt(self.cluster, [muon_group(ps, [f"e{i}" for i in range(len(ps))])],
                        **kw)
        try:
            for step in range(STEPS):
                for p, g in zip(ps, matrices(grad(shape, step))):
                    p.grad = g.clone()
                opt.step()
            return torch.stack([p.detach() for p in ps]).reshape(shape)
        finally:
            opt.close()

    def test_equals_its_matrices_as_separate_params_bitwise_and_torch_within_rounding(self):
        for shape in (SHAPE, DEEP):
            got, _ = self.run_batched(shape)
            self.assertTrue(torch.equal(got, self.run_separate(shape)), shape)
            ps = [torch.nn.Parameter(m.clone()) for m in matrices(initial(shape))]
            ref = TorchReference([muon_group(ps, [f"e{i}" for i in range(len(ps))])])
            for step in range(STEPS):
                for p, g in zip(ps, matrices(grad(shape, step))):
                    p.grad = g.clone()
                ref.step()
            want = torch.stack([p.detach() for p in ps]).reshape(shape)
            self.assertLess(rel_diff(got, want), REL_TOL, shape)
            self.assertGreater(rel_diff(want, initial(shape)), 100 * REL_TOL, shape)

    def test_batched_ns_equals_its_matrices_batched_alike(self):
        got, _ = self.run_batched(SHAPE, ns_batch_size=8)
        self.assertTrue(torch.equal(got, self.run_separate(SHAPE, ns_batch_size=8)))

    def test_state_has_the_param_shape_and_resumes_bitwise(self):
        want, _ = self.run_batched(SHAPE, steps=STEPS + 2)
        p = torch.nn.Parameter(initial(SHAPE))
        opt = muond_opt(self.cluster, [muon_group([p], ["experts"])])
        try:
            for step in range(STEPS):
                p.grad = grad(SHAPE, step)
                opt.step()
            saved = opt.state_dict()
            kept = p.detach().clone()
        finally:
            opt.close()
        momentum = saved["state"][0]["momentum_buffer"]
        self.assertEqual(tuple(momentum.shape), SHAPE)
        self.assertGreater(float(momentum.abs().min(dim=-1).values.max()), 0.0)
        p = torch.nn.Parameter(kept)
        opt = muond_opt(self.cluster, [muon_group([p], ["experts"])])
        try:
            opt.load_state_dict(saved)
            self.assertTrue(torch.equal(opt.state[p]["momentum_buffer"], momentum))
            for step in range(STEPS, STEPS + 2):
                p.grad = grad(SHAPE, step)
                opt.step()
        finally:
            opt.close()
        self.assertTrue(torch.equal(p.detach(), want))

    def test_grad_none_leaves_param_and_momentum_alone(self):
        p = torch.nn.Parameter(initial(SHAPE))
        q = torch.nn.Parameter(initial((12, 20), seed=1))
        opt = muond_opt(self.cluster, [muon_group([p, q], ["experts", "dense"])])
        try:
            p.grad, q.grad = grad(SHAPE, 0), grad((12, 20), 0)
            opt.step()
            before = p.detach().clone()
            momentum = opt.state[p]["momentum_buffer"].clone()
            p.grad, q.grad = None, grad((12, 20), 1)
            opt.step()
            self.assertTrue(torch.equal(p.detach(), before))
            self.assertTrue(torch.equal(opt.state[p]["momentum_buffer"], momentum))
        finally:
            opt.close()

    def test_params_without_a_matrix_and_clashing_names_are_refused(self):
        v = torch.nn.Parameter(torch.zeros(7))
        with self.assertRaisesRegex(ValueError, r"param bias: .*matrices .*shape \(7,\)"):
            muond_opt(self.cluster, [muon_group([v], ["bias"])])
        p = torch.nn.Parameter(initial(SHAPE))
        q = torch.nn.Parameter(initial((12, 20)))
        with self.assertRaisesRegex(ValueError, r"'experts\[0\]' appears twice"):
            muond_opt(self.cluster, [muon_group([p, q], ["experts", "experts[0]"])])


if __name__ == "__main__":
    unittest.main()
