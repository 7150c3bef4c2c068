"""The step contract, side by side: the same script runs against
torch.optim.Muon (+ torch.optim.AdamW for the AdamW group; NS in fp32) and
muond.torch.Muon on real daemons (a coordinator + 2 host daemons, the weights
split over both), and the params must agree to fp32 rounding (REL_TOL) after
every step; where the contract says a param must not move, bitwise.

Scenarios: grad None skips a param; requires_grad=False params are never
touched; momentum warm-up and nesterov changed live; OneCycleLR with
cycle_momentum (Muon momentum; AdamW beta1); betas/eps changed live;
rebinding (`p.data = ...`) followed or refused naming the param;
add_param_group (progressive unfreezing); `torch.save(opt)` works or fails at
save time saying why; a bad state dict (wrong shape, missing key, a
non-finite value) is refused naming the param and changes nothing, while the
same values in float64 load as torch.optim's cast does.
"""
import copy
import io
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (REL_TOL, ClusterTestCase, TorchReference, adamw_group,  # noqa: E402
                    bitwise_mismatches, muon_group, muond_opt, rel_diff)

SHAPES = {"w1": (16, 8), "w2": (8, 12), "bias": (8,), "emb": (6, 5)}


def initial_values():
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(*s, generator=g) * 0.3 for n, s in SHAPES.items()}


def set_grads(params, step, names=None):
    """Backward of a loss over `names` (default: every param that requires
    grad) into .grad; the others' .grad stays as it is (None after
    zero_grad())."""
    names = [n for n in (names or params) if params[n].requires_grad]
    g = torch.Generator().manual_seed(100 + step)
    loss = sum(((params[n] * params[n].sin()) * torch.randn(*params[n].shape, generator=g)).sum()
               for n in names)
    loss.backward()


class StepContractTest(ClusterTestCase):
    NUM_DAEMONS = 2

    # -- the harness -----------------------------------------------------------
    def make_params(self, frozen=()):
        return {n: torch.nn.Parameter(v.clone(), requires_grad=n not in frozen)
                for n, v in initial_values().items()}

    def side_by_side(self, build, script, steps, frozen=(), hooks=None):
        """Runs `script(opt, params, step)` then `opt.step()` for steps 1..N on
        both sides; returns {side: [snapshot after step s]} (snapshot 0 =
        initial). `build(params)` gives the param groups; `hooks(opt, side)`
        an optional per-step callable run after each step (a scheduler)."""
        out = {}
        for side in ("torch", "muond"):
            params = self.make_params(frozen)
            groups = build(params)
            opt = TorchReference(groups) if side == "torch" else muond_opt(self.cluster, groups)
            after = hooks(opt, side) if hooks else (lambda s: None)
            snaps = [{n: p.detach().clone() for n, p in params.items()}]
            try:
                for s in range(1, steps + 1):
                    script(opt, params, s)
                    opt.step()
                    after(s)
                    snaps.append({n: p.detach().clone() for n, p in params.items()})
            finally:
                opt.close()
            out[side] = snaps
        self.assert_agree(out)
        return out

    def assert_agree(self, out):
        bad = []
        for s, (t, m) in enumerate(zip(out["torch"], out["muond"])):
            for n in t:
                d = rel_diff(m[n], t[n])
                if not d <= REL_TOL:
                    bad.append(f"step {s} {n}: rel diff {d:.3g}")
        self.assertEqual(bad, [], "muond differs from torch.optim beyond fp32 rounding")

    @staticmethod
    def plain(opt, params, s):
        opt.zero_grad()
        set_grads(params, s)

    @staticmethod
    def mixed(params, muon=("w1", "w2"), adamw=("bias", "emb")):
        return [muon_group([params[n] for n in muon], list(muon)),
                adamw_group([params[n] for n in adamw], list(adamw))]

    # -- grad None, frozen -----------------------------------------------------
    def test_grad_none_skips_the_param(self):
        def script(opt, params, s):
            opt.zero_grad()  # set_to_none=True: torch's default
            set_grads(params, s, names=["w1", "emb"] if s == 3 else None)

        out = self.side_by_side(self.mixed, script, 4)
        for side, snaps in out.items():
            for n in ("w2", "bias"):  # no grad at step 3: not moved at all
                self.assertTrue(torch.equal(snaps[3][n], snaps[2][n]),
                                f"{side}: {n} moved at step 3 with grad None")
                self.assertFalse(torch.equal(snaps[4][n], snaps[3][n]), f"{side}: {n}")

    def test_requires_grad_false_params_are_never_touched(self):
        out = self.side_by_side(self.mixed, self.plain, 3, frozen=("w2", "emb"))
        for n in ("w2", "emb"):
            self.assertTrue(torch.equal(out["muond"][-1][n], out["muond"][0][n]),
                            f"frozen {n} changed")

    # -- live hyperparameters -----------------------------------------------------
    def test_momentum_warmup_and_nesterov_live(self):
        def script(opt, params, s):
            opt.param_groups[0]["momentum"] = 0.8 + 0.05 * (s - 1)  # 0.80 .. 0.95
            opt.param_groups[0]["nesterov"] = s != 3
            self.plain(opt, params, s)

        self.side_by_side(self.mixed, script, 4)

    def test_live_betas_and_eps(self):
        def script(opt, params, s):
            opt.param_groups[1]["betas"] = (0.8 + 0.04 * s, 0.999 - 0.02 * s)
            opt.param_groups[1]["eps"] = 10.0 ** (-8 + s)
            self.plain(opt, params, s)

        self.side_by_side(self.mixed, script, 4)

    def one_cycle(self, inner):
        def hooks(opt, side):
            target = getattr(opt, inner) if side == "torch" else opt
            sched = torch.optim.lr_scheduler.OneCycleLR(
                target, max_lr=0.05, total_steps=6, cycle_momentum=True,
                base_momentum=0.8, max_momentum=0.95)
            return lambda s: sched.step()
        return hooks

    def test_one_cycle_lr_cycles_muon_momentum(self):
        out = self.side_by_side(lambda p: [muon_group([p["w1"], p["w2"]], ["w1", "w2"])],
                                self.plain, 5, hooks=self.one_cycle("muon"))
        self.assertIsNotNone(out)

    def test_one_cycle_lr_cycles_adamw_beta1(self):
        self.side_by_side(lambda p: [adamw_group([p["bias"], p["emb"]], ["bias", "emb"])],
                          self.plain, 5, hooks=self.one_cycle("adamw"))

    # -- rebinding, add_param_group, pickling ---------------------------------------
    def test_rebinding_is_followed_or_refused_naming_the_param(self):
        params = self.make_params()
        ref_params = self.make_params()
        ref = TorchReference(self.mixed(ref_params))
        opt = muond_opt(self.cluster, self.mixed(params))
        try:
            for side_opt, ps in ((ref, ref_params), (opt, params)):
                self.plain(side_opt, ps, 1)
                side_opt.step()
                ps["w1"].data = ps["w1"].data.clone() * 0.5  # new storage
                self.plain(side_opt, ps, 2)
            before = {n: p.detach().clone() for n, p in params.items()}
            ref.step()
            try:
                opt.step()
            except Exception as e:  # refused: must name w1 and change nothing
                self.assertIn("w1", str(e))
                self.assertEqual(bitwise_mismatches(
                    {n: p.detach() for n, p in params.items()}, before), [])
                return
            for n in params:  # followed: w1 moved from its new value as torch's did
                d = rel_diff(params[n].detach(), ref_params[n].detach())
                self.assertLessEqual(d, REL_TOL, n)
        finally:
            opt.close()

    def test_add_param_group_progressive_unfreezing(self):
        def build(p):
            return [muon_group([p["w1"]], ["w1"])]

        def script(opt, params, s):
            if s == 3:
                params["w2"].requires_grad_(True)
                opt.add_param_group(muon_group([params["w2"]], ["w2"], name="late"))
            if s == 4:
                params["bias"].requires_grad_(True)
                opt.add_param_group(adamw_group([params["bias"]], ["bias"], name="late_adam"))
            opt.zero_grad()
            set_grads(params, s)

        out = self.side_by_side(build, script, 5, frozen=("w2", "bias", "emb"))
        for side, snaps in out.items():
            self.assertTrue(torch.equal(snaps[2]["w2"], snaps[0]["w2"]), side)
            self.assertFalse(torch.equal(snaps[5]["w2"], snaps[2]["w2"]), side)
            self.assertFalse(torch.equal(snaps[5]["bias"], snaps[3]["bias"]), side)

    def test_pickling_works_or_fails_at_save_saying_why(self):
        # torch: 4 uninterrupted steps (pickling a torch optimizer is exact).
        ref_params = self.make_params()
        ref = TorchReference(self.mixed(ref_params))
        for s in range(1, 5):
            self.plain(ref, ref_params, s)
            ref.step()

        params = self.make_params()
        opt = muond_opt(self.cluster, self.mixed(params))
        try:
            for s in range(1, 3):
                self.plain(opt, params, s)
                opt.step()
            buf = io.BytesIO()
            try:
                torch.save({"opt": opt, "params": params}, buf)
            except Exception as e:
                self.assertRegex(str(e), "(?i)muond|Muon",
                                 f"torch.save(opt) failed without saying why: {e!r}")
                return
        finally:
            opt.close()
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        opt, params = loaded["opt"], loaded["params"]
        try:
            for s in range(3, 5):
                self.plain(opt, params, s)
                opt.step()
        finally:
            opt.close()
        for n in params:
            self.assertLessEqual(rel_diff(params[n].detach(), ref_params[n].detach()),
                                 REL_TOL, n)

    # -- bad input -------------------------------------------------------------------
    def test_bad_state_dict_is_refused_naming_the_param_and_changes_nothing(self):
        def run(steps, between=None):
            params = self.make_params()
            opt = muond_opt(self.cluster, self.mixed(params))
            try:
                for s in range(1, steps + 1):
                    if s == steps and between:
                        between(opt, params)
                    self.plain(opt, params, s)
                    opt.step()
            finally:
                opt.close()
            return {n: p.detach().clone() for n, p in params.items()}

        want = run(3)

        def refuse_bad_loads(opt, params):
            sd = opt.state_dict()
            snapshot = {n: p.detach().clone() for n, p in params.items()}
            wrong_shape = copy.deepcopy(sd)
            wrong_shape["state"][0]["momentum_buffer"] = torch.zeros(3, 3)  # w1
            with self.assertRaisesRegex(Exception, "w1"):
                opt.load_state_dict(wrong_shape)
            missing = copy.deepcopy(sd)
            del missing["state"][2]["exp_avg"]  # bias
            with self.assertRaisesRegex(Exception, "bias"):
                opt.load_state_dict(missing)
            non_finite = copy.deepcopy(sd)
            non_finite["state"][1]["momentum_buffer"][0, 0] = float("nan")  # w2
            with self.assertRaisesRegex(Exception, "w2"):
                opt.load_state_dict(non_finite)
            self.assertEqual(bitwise_mismatches(
                {n: p.detach() for n, p in params.items()}, snapshot), [])
            after = opt.state_dict()
            for i, entry in sd["state"].items():
                for k, v in entry.items():
                    self.assertTrue(torch.equal(torch.as_tensor(after["state"][i][k]),
                                                torch.as_tensor(v)), f"state[{i}][{k}]")
            # torch.optim casts a loaded state to the param's dtype: the same
            # values in float64 load (and the run goes on bitwise, below).
            as_double = copy.deepcopy(sd)
            for entry in as_double["state"].values():
                for k, v in entry.items():
                    if torch.is_tensor(v) and v.is_floating_point():
                        entry[k] = v.double()
            opt.load_state_dict(as_double)

        got = run(3, between=refuse_bad_loads)
        self.assertEqual(bitwise_mismatches(got, want), [])


if __name__ == "__main__":
    unittest.main()
