"""bf16 params on real host daemons with state_dtype "auto": the daemons keep a
bf16 momentum and bf16 AdamW moments, as torch.optim.Muon and
torch.optim.AdamW keep theirs for bf16 params, and the run follows theirs
(NS in fp32 on both sides: common.py) within bf16 rounding: after each step
the momentum and the moments within one bf16 unit in the last place, the
params within two (without weight decay, which torch rounds apart from the
update and muond with it). fp8_e4m3 state on the same params stays near the bf16 run: the
momentum within the e4m3 step (a 3-bit mantissa) of the block's scale."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ClusterTestCase, TorchReference, adamw_group, muon_group,  # noqa: E402
                    muond_opt)

STEPS = 3
BF16_ULP = torch.finfo(torch.bfloat16).eps  # 2^-7 relative, at the top of a binade
SHAPES = {"fc1": (16, 8), "fc2": (8, 16), "bias": (8,)}


def bf16_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).bfloat16())
            for n, s in SHAPES.items()}


def groups(params):
    # No weight decay: torch rounds p * (1 - lr wd) to bf16 before it adds the
    # update (a decay below half an ulp is lost there), muond rounds once, so
    # with decay the two would differ by the decay itself, not by rounding.
    return [dict(muon_group([params["fc1"], params["fc2"]], ["fc1", "fc2"]), weight_decay=0.0),
            dict(adamw_group([params["bias"]], ["bias"]), weight_decay=0.0)]


def bf16_grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g).bfloat16() for n, s in SHAPES.items()}


def state_of(state, params):
    """Each param's state tensors in `state` (an optimizer's, by param) as fp32
    copies, by key."""
    return {n: {k: v.detach().float().clone() for k, v in state[p].items()
                if torch.is_tensor(v) and v.dim() > 0}
            for n, p in params.items()}


def torch_state(ref):
    """The state of a TorchReference's optimizers together."""
    merged = {}
    for o in ref.optimizers():
        merged.update(o.state)
    return merged


def assert_within_ulps(test, got, want, ulps, what):
    # One ulp of a bf16 value x is at most 2^-7 |x|; near zero, that of the
    # tensor's largest value / 2^8 bounds what the two roundings can differ by.
    tol = ulps * BF16_ULP * torch.maximum(want.abs(), want.abs().max() / 256)
    bad = (got - want).abs() > tol
    test.assertFalse(bool(bad.any()), f"{what}: {int(bad.sum())} elements beyond {ulps} "
                     f"bf16 ulp(s); max diff {float((got - want).abs().max()):.3e}")


class Bf16StateTest(ClusterTestCase):
    def run_muond(self, state_dtype=None):
        params = bf16_params()
        kw = {} if state_dtype is None else {"state_dtype": state_dtype}
        opt = muond_opt(self.cluster, groups(params), **kw)
        states = []
        try:
            for step in range(STEPS):
                for n, g in bf16_grads(step).items():
                    params[n].grad = g
                opt.step()
                states.append(state_of(opt.state, params))
            by = {(e.location, e.dtype) for c in opt.clients for e in c.status().state_bytes_by}
        finally:
            opt.close()
        return params, states, by

    def test_auto_state_is_bf16_and_follows_torch(self):
        params, states, by = self.run_muond()
        self.assertEqual(by, {("device", "bf16")})
        ref_params = bf16_params()
        ref = TorchReference(groups(ref_params))
        start = {n: p.detach().float().clone() for n, p in ref_params.items()}
        for step in range(STEPS):
            for n, g in bf16_grads(step).items():
                ref_params[n].grad = g
            ref.step()
            ref_states = torch_state(ref)
            want = state_of(ref_states, ref_params)
            for n in SHAPES:
                key = "momentum_buffer" if n != "bias" else "exp_avg"
                ref_state = ref_states[ref_params[n]][key]
                self.assertEqual(ref_state.dtype, torch.bfloat16, f"torch's {n}.{key}")
                for k, w in want[n].items():
                    assert_within_ulps(self, states[step][n][k], w, 1,
                                       f"step {step + 1} {n}.{k}")
        for n, p in params.items():
            self.assertEqual(p.dtype, torch.bfloat16, n)
            want = ref_params[n].detach().float()
            assert_within_ulps(self, p.detach().float(), want, 2, f"param {n}")
            # The steps moved the params well beyond the tolerance.
            moved = float((want - start[n]).abs().max())
            self.assertGreater(moved, 8 * BF16_ULP * float(want.abs().max()) / 256, n)

    def test_fp8_state_stays_near_bf16_state(self):
        _, bf16_states, _ = self.run_muond("bf16")
        _, fp8_states, by = self.run_muond("fp8_e4m3")
        self.assertEqual(by, {("device", "fp8_e4m3")})
        for n in ("fc1", "fc2"):
            want = bf16_states[-1][n]["momentum_buffer"]
            got = fp8_states[-1][n]["momentum_buffer"]
            # e4m3 keeps 3 mantissa bits: a stored value is within 2^-4 of
            # itself, and every step rounds again (a few such steps), plus
            # subnormal codes near zero (absmax / 448 / 2^9 per block).
            tol = 4 * 2.0 ** -4 * got.abs().max()
            self.assertLess(float((got - want).abs().max()), float(tol), n)
            self.assertGreater(float(got.abs().max()), 0.0, n)


class Bf16StateLoadAcrossRanksTest(ClusterTestCase):
    """A state dict one rank's bf16 state cannot hold (a value that rounds to
    inf) is refused as a whole: every daemon checks at PREPARE, so no rank
    commits it alone and the next step runs on the old state everywhere."""
    NUM_DAEMONS = 2

    def test_a_value_bf16_cannot_hold_loads_on_no_rank(self):
        params = {n: torch.nn.Parameter(p.detach().float()) for n, p in bf16_params().items()}
        opt = muond_opt(self.cluster, groups(params), state_dtype="bf16")
        try:
            for step in range(2):
                for n, g in bf16_grads(step).items():
                    params[n].grad = g.float()
                opt.step()
            before = state_of(opt.state, params)
            sd = opt.state_dict()
            for st in sd["state"].values():  # a change that must not land
                for k in ("momentum_buffer", "exp_avg"):
                    if k in st:
                        st[k] = st[k] + 0.5
            last = max(i for i, st in sd["state"].items() if "momentum_buffer" in st)
            sd["state"][last]["momentum_buffer"].view(-1)[-1] = 3.3995e38
            with self.assertRaisesRegex(Exception, "overflows the group's bf16 state"):
                opt.load_state_dict(sd)
            after = state_of(opt.state, params)
            for n in params:
                for k, v in before[n].items():
                    self.assertTrue(torch.equal(after[n][k], v), f"{n} {k} changed")
            opt.step()  # the job goes on, on every rank
        finally:
            opt.close()


if __name__ == "__main__":
    unittest.main()
