"""split_qkv on real host daemons: a fused QKV weight in Megatron's layout
(per query group its query, key and value rows) with split_qkv=True steps as
its Q, K and V given as separate params (bitwise: the same math on the same
backend; per head with qkv_head_dim, each head's rows), and within REL_TOL of
torch.optim.Muon on those parts (NS in fp32). The parts are cut here with the
seed's own rule (view (groups, q + k + v, -1), split dim 1), not muond's.
Its state has the param's shape with each part's momentum in its rows, and
resumes bitwise; grad None leaves it alone; bad options are named."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (REL_TOL, ClusterTestCase, TorchReference, muon_group,  # noqa: E402
                    muond_opt, rel_diff)

STEPS = 3
SHAPES = (4, 2, 2)  # rows of q, k, v per query group (2 query heads of 2 rows)
GROUPS, COLS = 3, 12
ROWS = GROUPS * sum(SHAPES)


def is_qkv(p):
    return getattr(p, "is_qkv", False)


def split_kw(head_dim=None):
    kw = dict(split_qkv=True, is_qkv_fn=is_qkv, qkv_split_shapes=list(SHAPES))
    return kw if head_dim is None else dict(kw, qkv_head_dim=head_dim)


def parts(t, head_dim=None):
    grouped = t.reshape(GROUPS, sum(SHAPES), COLS)
    qkv = torch.split(grouped, list(SHAPES), dim=1)
    if head_dim is None:
        return [x.reshape(-1, COLS) for x in qkv]
    return [h for g in range(GROUPS) for x in qkv for h in torch.split(x[g], head_dim)]


def whole(ps, head_dim=None):
    if head_dim is None:
        return torch.cat([x.reshape(GROUPS, -1, COLS) for x in ps], dim=1).reshape(ROWS, COLS)
    return torch.cat(ps).reshape(ROWS, COLS)


def initial(seed=0):
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)) * 0.3


def grad(step):
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(100 + step))


def fused_param(value=None):
    p = torch.nn.Parameter(initial() if value is None else value)
    p.is_qkv = True
    return p


class SplitQkvTest(ClusterTestCase):
    NUM_DAEMONS = 2  # split mode: the parts spread over both daemons

    def run_fused(self, head_dim=None, steps=STEPS):
        p = fused_param()
        opt = muond_opt(self.cluster, [muon_group([p], ["qkv"])], **split_kw(head_dim))
        try:
            for step in range(steps):
                p.grad = grad(step)
                opt.step()
            return p.detach().clone(), opt.state_dict()
        finally:
            opt.close()

    def run_parts(self, head_dim=None):
        ps = [torch.nn.Parameter(x.clone()) for x in parts(initial(), head_dim)]
        names = [f"part{i}" for i in range(len(ps))]
        opt = muond_opt(self.cluster, [muon_group(ps, names)])
        ref = [torch.nn.Parameter(x.clone()) for x in parts(initial(), head_dim)]
        torch_opt = TorchReference([muon_group(ref, names)])
        try:
            for step in range(STEPS):
                for a, b, g in zip(ps, ref, parts(grad(step), head_dim)):
                    a.grad, b.grad = g.clone(), g.clone()
                opt.step()
                torch_opt.step()
            momentum = whole([opt.state[p]["momentum_buffer"] for p in ps], head_dim)
            return (whole([p.detach() for p in ps], head_dim),
                    whole([p.detach() for p in ref], head_dim), momentum)
        finally:
            opt.close()

    def test_equals_q_k_v_as_separate_params_and_torch(self):
        for head_dim in (None, 2):
            got, state = self.run_fused(head_dim)
            want, torch_want, momentum = self.run_parts(head_dim)
            self.assertTrue(torch.equal(got, want), head_dim)
            self.assertTrue(torch.equal(state["state"][0]["momentum_buffer"], momentum))
            self.assertLess(rel_diff(got, torch_want), REL_TOL, head_dim)
        # Split apart, the update differs from the fused matrix's well beyond
        # the tolerance: the comparison above can tell the two apart.
        unsplit = fused_param()
        opt = muond_opt(self.cluster, [muon_group([unsplit], ["qkv"])])
        try:
            for step in range(STEPS):
                unsplit.grad = grad(step)
                opt.step()
        finally:
            opt.close()
        self.assertGreater(rel_diff(unsplit.detach(), got), 100 * REL_TOL)

    def test_state_resumes_bitwise_and_grad_none_leaves_it_alone(self):
        want, _ = self.run_fused(steps=STEPS + 1)
        kept, saved = self.run_fused(steps=STEPS)
        p = fused_param(kept)
        opt = muond_opt(self.cluster, [muon_group([p], ["qkv"])], **split_kw())
        try:
            opt.load_state_dict(saved)
            p.grad = None
            opt.step()
            self.assertTrue(torch.equal(p.detach(), kept))
            self.assertTrue(torch.equal(opt.state[p]["momentum_buffer"],
                                        saved["state"][0]["momentum_buffer"]))
            p.grad = grad(STEPS)
            opt.step()
        finally:
            opt.close()
        self.assertTrue(torch.equal(p.detach(), want))

    def test_bad_options_and_shapes_are_named(self):
        cases = [
            (dict(split_qkv=True, qkv_split_shapes=[4, 2, 2]), "requires both is_qkv_fn"),
            (dict(split_qkv=True, is_qkv_fn=is_qkv, qkv_split_shapes=[4, 0, 2]),
             "qkv_split_shapes must be a list of positive ints"),
            (dict(split_kw(), qkv_split_shapes=[5, 2, 2]), r"param qkv: .* 24 % 9 != 0"),
            (dict(split_kw(), qkv_head_dim=3), r"qkv_head_dim=3 does not divide"),
            (dict(qkv_head_dim=2), "qkv_head_dim needs split_qkv=True"),
        ]
        for kw, message in cases:
            with self.assertRaisesRegex(ValueError, message, msg=str(kw)):
                muond_opt(self.cluster, [muon_group([fused_param()], ["qkv"])], **kw)


if __name__ == "__main__":
    unittest.main()
