"""NorMuon and AdaMuon (Muon(variant=...)) on real host daemons, split over
two daemons (rows of one param, columns of another: row-parallel, where a
NorMuon row sum adds both daemons' parts), against the float64 reference
written from dion's and Emerging-Optimizers' sources
(muon_variants_reference.py): params and both states within fp32 rounding
after every step, with a live lr change, an all-zero grad (no NaN) and a
grad None (param and both states unchanged). State in torch.optim's format
(dion's ``variance_neuron`` [rows, 1], Emerging-Optimizers'
``moment2_buffer``) resumes bitwise through torch.save; a wrong-shaped or
negative second moment is refused naming the param."""
import io
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ClusterTestCase, muon_group, muond_opt, rel_diff  # noqa: E402
from muon_variants_reference import Reference  # noqa: E402

# fp32 against float64: the NS and the division by sqrt(v) + eps in fp32.
TOL = 2e-5
SHAPES = {"rows": (12, 20), "cols": (9, 16), "tall": (20, 12)}  # cols: 9 rows do not split
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
SECOND = {"normuon": "variance_neuron", "adamuon": "moment2_buffer"}


def initial(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.3 for n, s in SHAPES.items()}


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


class MuonVariantsTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def make(self, variant, values=None, **kw):
        values = initial() if values is None else values
        ps = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
        opt = muond_opt(self.cluster, [muon_group(list(ps.values()), list(ps))],
                        variant=variant, beta2=0.9, **HYPER, **kw)
        self.addCleanup(opt.close)
        return ps, opt

    def test_steps_match_the_float64_reference_with_zero_none_grads_and_live_lr(self):
        for variant in ("normuon", "adamuon"):
            with self.subTest(variant=variant):
                ps, opt = self.make(variant)
                names = list(ps)
                ref = Reference([initial()[n] for n in names], variant, beta2=0.9, **HYPER)
                for step in range(5):
                    g = grads(step)
                    if step == 2:  # live lr
                        opt.param_groups[0]["lr"] = ref.lr = 0.005
                    if step == 3:
                        g["rows"] = torch.zeros(SHAPES["rows"])
                    if step == 4:
                        g["cols"] = None
                        before = {k: v.clone() for k, v in opt.state[ps["cols"]].items()}
                        kept = ps["cols"].detach().clone()
                    for n in names:
                        ps[n].grad = g[n]
                    opt.step()
                    ref.step([g[n] for n in names])
                    for i, n in enumerate(names):
                        state = opt.state[ps[n]]
                        self.assertTrue(torch.isfinite(ps[n]).all(), (step, n))
                        self.assertLess(rel_diff(ps[n].detach(), ref.params[i]), TOL, (step, n))
                        self.assertLess(rel_diff(state["momentum_buffer"], ref.momentum[i]),
                                        TOL, (step, n))
                        second = state[SECOND[variant]]
                        self.assertEqual(second.shape, ref.second[i].shape, n)
                        self.assertLess(rel_diff(second, ref.second[i]), TOL, (step, n))
                self.assertTrue(torch.equal(ps["cols"].detach(), kept))
                for k, v in opt.state[ps["cols"]].items():
                    self.assertTrue(torch.equal(v, before[k]), k)
                moved = rel_diff(ref.params[0], initial()["rows"].double())
                self.assertGreater(moved, 1000 * TOL)
                opt.close()

    def run_steps(self, opt, ps, steps):
        for step in steps:
            for n, g in grads(step).items():
                ps[n].grad = g
            opt.step()

    def test_resume_through_torch_save_is_bitwise(self):
        for variant in ("normuon", "adamuon"):
            with self.subTest(variant=variant):
                ps, opt = self.make(variant)
                self.run_steps(opt, ps, range(5))
                want = {n: p.detach().clone() for n, p in ps.items()}
                opt.close()
                ps, opt = self.make(variant)
                self.run_steps(opt, ps, range(3))
                buffer = io.BytesIO()
                torch.save({"opt": opt.state_dict(),
                            "params": {n: p.detach() for n, p in ps.items()}}, buffer)
                opt.close()
                buffer.seek(0)
                saved = torch.load(buffer)
                ps, opt = self.make(variant, values=saved["params"])
                opt.load_state_dict(saved["opt"])
                key = SECOND[variant]
                state = opt.state[ps["rows"]]
                self.assertEqual(set(state), {"momentum_buffer", key})
                self.assertTrue(torch.equal(state[key], saved["opt"]["state"][0][key]))
                self.run_steps(opt, ps, range(3, 5))
                for n in ps:
                    self.assertTrue(torch.equal(ps[n].detach(), want[n]), n)
                opt.close()

    def test_wrong_shaped_or_negative_second_moments_are_refused_naming_the_param(self):
        ps, opt = self.make("normuon")
        self.run_steps(opt, ps, range(1))
        saved = opt.state_dict()
        for value, message in [(torch.ones(12), r"param rows: .*'variance_neuron'.* shape"),
                               (-torch.ones(12, 1), r"param rows: .*'variance_neuron'.* "
                                                    "negative")]:
            with self.subTest(message=message):
                bad = {**saved, "state": {**saved["state"],
                                          0: {**saved["state"][0], "variance_neuron": value}}}
                with self.assertRaisesRegex(ValueError, message):
                    opt.load_state_dict(bad)
        self.assertTrue(torch.equal(opt.state[ps["rows"]]["variance_neuron"],
                                    saved["state"][0]["variance_neuron"]))
        opt.close()
        ps, opt = self.make("adamuon")
        self.run_steps(opt, ps, range(1))
        saved = opt.state_dict()
        bad = {**saved, "state": {**saved["state"],
                                  1: {**saved["state"][1],
                                      "moment2_buffer": -saved["state"][1]["moment2_buffer"]}}}
        with self.assertRaisesRegex(ValueError, r"param cols: .*'moment2_buffer'.* negative"):
            opt.load_state_dict(bad)


if __name__ == "__main__":
    unittest.main()
