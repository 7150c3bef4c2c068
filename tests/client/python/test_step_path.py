"""muond.torch.Muon's step path through fake daemons (fake_daemon.py, which
applies StepRequest.skip_params and GroupOverride as the wire says), against
the in-process ReferenceMuon (examples/char_gpt, the same math, torch.optim's
grad-None rule and live param_groups): torch.optim's contract of zero_grad,
grad None, requires_grad=False and per-step hyperparameters, and what the
client refuses before any RPC. The same scenarios against torch.optim.Muon /
AdamW on real daemons: the contract suite (contract/test_step_contract.py)."""
import collections
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import start_cluster  # noqa: E402
from test_muon_fake_daemon import HYPER, PARAMS, groups, make_params  # noqa: E402
from muond.torch import Muon  # noqa: E402
from muond.torch import groups as muond_groups  # noqa: E402
from reference_muon import ReferenceMuon  # noqa: E402

SKIPPED = ("w_tp0", "w_solo", "bias")  # split over both daemons; solo; AdamW


def train(opt, params, steps=4, skipped=(), schedule=None):
    """zero_grad() (set_to_none, torch's default), then a backward that reaches
    every param except `skipped`, then step(); `schedule(step, opt)` may edit
    param_groups first."""
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=g)).sum()
                   for n, p in params.items() if n not in skipped)
        loss.backward()
        if schedule is not None:
            schedule(step, opt)
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


class StepPathTest(unittest.TestCase):
    def setUp(self):
        d = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        self.cluster, self.addresses = start_cluster(d, 2)
        self.addCleanup(lambda: [x.stop() for x in self.cluster.daemons])

    def muon(self, params, **kw):
        opt = Muon(groups(params), daemons=self.addresses, job_id="steppath", gtp_size=2,
                   tp_size=1, **(HYPER | kw))
        self.addCleanup(opt.close)
        return opt

    def assert_same(self, got, want):
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_grad_none_params_are_skipped_on_every_daemon_holding_them(self):
        ref_params, params = make_params(), make_params()
        initial = {n: p.detach().clone() for n, p in params.items()}
        want = train(ReferenceMuon(groups(ref_params), **HYPER), ref_params, skipped=SKIPPED)
        opt = self.muon(params)
        got = train(opt, params, skipped=SKIPPED)
        self.assert_same(got, want)
        for name in SKIPPED:  # as torch leaves them: unchanged
            self.assertTrue(torch.equal(got[name], initial[name]), name)
            self.assertIsNone(params[name].grad, name)
        for rank, daemon in enumerate(self.cluster.daemons):
            holds = {p.name for g in daemon.requests[0].groups for p in g.params}
            for request in daemon.step_requests:
                self.assertEqual(set(request.skip_params), holds & set(SKIPPED), rank)
        # w_tp0 is split over both daemons: both name it, the step agrees.
        self.assertTrue(all("w_tp0" in d.step_requests[0].skip_params
                            for d in self.cluster.daemons))

    def test_requires_grad_false_params_are_never_touched(self):
        params = make_params()
        params["w_tall"].requires_grad_(False)
        params["norm"].requires_grad_(False)
        frozen = {n: params[n].detach().clone() for n in ("w_tall", "norm")}
        opt = self.muon(params)
        self.assertIsNone(params["w_tall"].grad)  # no zero grad given at construction
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            sum((p * torch.randn(p.shape, generator=g)).sum()
                for p in params.values() if p.requires_grad).backward()
            params["norm"].grad = torch.ones(4)  # even with a grad: frozen means frozen
            opt.step()
        for name, before in frozen.items():
            self.assertTrue(torch.equal(params[name].detach(), before), name)
        self.assertIn("norm", [n for d in self.cluster.daemons
                               for n in d.step_requests[-1].skip_params])

    def test_first_step_without_zero_grad_skips_params_backward_did_not_reach(self):
        """Construction leaves .grad as torch.optim does (None on a fresh
        model, a user's grad kept as is): a first step with no zero_grad()
        before it skips a param the backward did not reach (bitwise
        unchanged, no weight decay) as ReferenceMuon / torch.optim do."""
        ref_params, params = make_params(), make_params()
        given = torch.ones_like(params["w_pad_tp1"])
        for ps in (ref_params, params):
            ps["w_pad_tp1"].grad = given.clone()  # a grad the user set before construction
        initial = {n: p.detach().clone() for n, p in params.items()}
        ref, opt = ReferenceMuon(groups(ref_params), **HYPER), self.muon(params)
        self.assertIsNone(params["w_tall"].grad)
        self.assertTrue(torch.equal(params["w_pad_tp1"].grad, given))
        for o, ps in ((ref, ref_params), (opt, params)):
            g = torch.Generator().manual_seed(9)
            sum((p * torch.randn(p.shape, generator=g)).sum()
                for n, p in ps.items() if n not in SKIPPED).backward()
            o.step()
        self.assert_same({n: p.detach() for n, p in params.items()},
                         {n: p.detach() for n, p in ref_params.items()})
        for name in SKIPPED:
            self.assertTrue(torch.equal(params[name].detach(), initial[name]), name)
            self.assertIsNone(params[name].grad, name)

    def test_zero_grad_set_to_none_and_in_place(self):
        params = make_params()
        opt = self.muon(params)
        shared = {id(p): grad for p, grad in opt._grads}
        w = params["w_pad_tp1"]
        (w * 2).sum().backward()
        opt.zero_grad(set_to_none=False)  # zeroes the shared buffer, keeps it
        self.assertIs(w.grad, shared[id(w)])
        self.assertEqual(float(w.grad.abs().sum()), 0.0)
        opt.zero_grad()  # torch's default: None
        self.assertIsNone(w.grad)
        (w * 3).sum().backward()  # a fresh grad: copied in at step, .grad re-pointed
        self.assertIsNot(w.grad, shared[id(w)])
        opt.step()
        self.assertIs(w.grad, shared[id(w)])
        self.assertTrue(torch.equal(w.grad, torch.full_like(w, 3.0)))

    def test_zero_copy_steps_still_see_every_change_to_a_param(self):
        # After steps whose grads were in place (the per-step checks then run
        # once over all params, not per param), each change is still caught:
        # a rebound param followed, one rebound in place to another shape
        # refused, requires_grad False skipped, a replaced param and a sparse
        # grad refused, all before any RPC; the reference steps alike.
        ref_params, params = make_params(), make_params()
        ref, opt = ReferenceMuon(groups(ref_params), **HYPER), self.muon(params)
        g = torch.Generator().manual_seed(4)

        def zero_copy_step():
            grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
            for o, ps in ((ref, ref_params), (opt, params)):
                o.zero_grad(set_to_none=False)
                sum((p * grads[n]).sum() for n, p in ps.items() if p.requires_grad).backward()
                if o is ref:  # muond skips a requires_grad=False param: the reference's grad None
                    for p in ps.values():
                        if not p.requires_grad:
                            p.grad = None
                o.step()
            self.assert_same({n: p.detach() for n, p in params.items()},
                             {n: p.detach() for n, p in ref_params.items()})

        for _ in range(2):
            zero_copy_step()
        shared = {id(p): grad for p, grad in opt._grads}
        self.assertTrue(all(p.grad is shared[id(p)] for p in params.values()))
        view = {id(p): v for p, v, _ in opt._views}
        new = torch.randn(params["w_tp0"].shape, generator=g)
        ref_params["w_tp0"].data = new.clone()
        params["w_tp0"].data = new.clone()  # same shape/dtype/device: followed
        zero_copy_step()
        w = params["w_tp0"]
        self.assertEqual(w.data_ptr(), view[id(w)].data_ptr())
        sent = len(self.cluster.daemons[0].step_requests)

        def refused(error, pattern):
            with self.assertRaisesRegex(error, pattern):
                opt.step()
            self.assertEqual(self.cluster.daemons[0].step_requests[-1].step_id, opt.step_id + 1)
            self.assertTrue(self.cluster.daemons[0].step_requests[-1].trainer_refusal)

        w.data = view[id(w)].view(-1)  # the same address, another shape
        refused(ValueError, r"param w_tp0: shape \(8, 6\) -> \(48,\)")
        w.data = view[id(w)]
        ref_params["norm"].requires_grad_(False)
        params["norm"].requires_grad_(False)
        zero_copy_step()  # skipped on both
        self.assertIn("norm", [n for d in self.cluster.daemons
                               for n in d.step_requests[-1].skip_params])
        ref_params["norm"].requires_grad_(True)
        params["norm"].requires_grad_(True)
        zero_copy_step()
        group = opt.param_groups[0]
        kept = group["params"][1]
        group["params"][1] = torch.nn.Parameter(kept.detach().clone())
        refused(ValueError, r"param w_tp0: not the tensor registered in its place")
        group["params"][1] = kept
        params["bias"].grad = torch.ones(9).to_sparse()
        refused(RuntimeError, r"param bias: its grad is sparse")
        params["bias"].grad = shared[id(params["bias"])]
        zero_copy_step()
        self.assertEqual(len(self.cluster.daemons[0].step_requests), sent + 3 + 3)
        self.assertEqual(opt.step_id, 6)

    def zero_copy_steps(self, changes, steps=3):
        """Zero-copy steps (zero_grad(set_to_none=False), backward, step) of
        muond and the reference, each bitwise the same; ``changes(step, ps,
        grads, opt)`` edits muond's params or grads (opt) or the reference's
        (opt None) after the backward. Returns muond's optimizer."""
        ref_params, params = make_params(), make_params()
        ref, opt = ReferenceMuon(groups(ref_params), **HYPER), self.muon(params)
        g = torch.Generator().manual_seed(6)
        for step in range(steps):
            grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
            for o, ps in ((ref, ref_params), (opt, params)):
                o.zero_grad(set_to_none=False)
                sum((p * grads[n]).sum() for n, p in ps.items()).backward()
                changes(step, ps, grads, o if o is opt else None)
                o.step()
            self.assert_same({n: p.detach() for n, p in params.items()},
                             {n: p.detach() for n, p in ref_params.items()})
        return opt

    def test_a_grad_over_the_shared_grads_steps_with_the_values_it_holds(self):
        # A .grad that is another tensor over the shared grad memory is
        # stepped with the values it holds: a view of its own shared grad
        # at the same address laid out otherwise (column-major: re-pointing
        # .grad without a copy stepped the grad transposed), and a view of
        # another param's shared grad whose own grad is replaced in the same
        # step (read before that copy overwrites it, whatever the order).
        def changes(step, ps, grads, opt):
            if step == 1 and opt is not None:  # the reference keeps its grad as it is
                w = ps["w_tp0"]
                relaid = w.grad.view(6, 8).t()  # (8, 6) at the same address, strides (1, 8)
                with torch.no_grad():
                    relaid.copy_(grads["w_tp0"])
                w.grad = relaid
            if step == 2:
                for a, b in (("norm", "bias"), ("emb", "w_tall")):
                    ps[a].grad = ps[b].grad[:len(ps[a])]  # b's grad, read as it is now
                    ps[b].grad = torch.full_like(ps[b], 0.5)

        self.zero_copy_steps(changes)

    def test_a_grad_moved_in_place_is_stepped_and_its_span_kept(self):
        # Old-style code that rescales a grad by replacing its memory
        # (p.grad.data = p.grad.data / n, or p.grad.set_(...)) keeps the
        # same .grad object, which is the shared grad: its values are the
        # step's grad (not the span's stale ones), and the object is at its
        # span again for the steps after (zero_grad, backward in place).
        def changes(step, ps, grads, opt):
            if step == 1:
                for name in ("w_tp0", "bias"):
                    ps[name].grad.data = ps[name].grad.data / 4
            if step == 2:
                with torch.no_grad():
                    ps["w_tall"].grad.set_(ps["w_tall"].grad * 3)

        opt = self.zero_copy_steps(changes, steps=4)
        spans = {id(p): v for p, v in zip([p for p, _ in opt._grads], opt._memory._grad_homes)}
        for p, grad in opt._grads:
            self.assertIs(p.grad, grad)
            self.assertEqual(grad.data_ptr(), spans[id(p)].data_ptr())

    def test_frozen_params_keep_the_zero_copy_fast_path(self):
        # requires_grad False params (LoRA's base weights) are skipped, as
        # their grad is None, without turning the others' checks into a loop
        # per param; unfreezing one is seen at the next step.
        ref_params, params = make_params(), make_params()
        frozen = ("w_solo", "norm")
        for ps in (ref_params, params):
            for n in frozen:
                ps[n].requires_grad_(False)
        ref, opt = ReferenceMuon(groups(ref_params), **HYPER), self.muon(params)
        g = torch.Generator().manual_seed(8)
        for step in range(4):
            if step == 3:
                for ps in (ref_params, params):
                    ps["w_solo"].requires_grad_(True)
            grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
            for o, ps in ((ref, ref_params), (opt, params)):
                o.zero_grad(set_to_none=False)
                sum((p * grads[n]).sum() for n, p in ps.items() if p.requires_grad).backward()
                if o is opt and 0 < step < 3:
                    self.assertTrue(opt._memory.grads_in_place(), step)
                o.step()
            self.assert_same({n: p.detach() for n, p in params.items()},
                             {n: p.detach() for n, p in ref_params.items()})
            skipped = set().union(*(d.step_requests[-1].skip_params
                                    for d in self.cluster.daemons))
            self.assertEqual(skipped, set(frozen) if step < 3 else {"norm"}, step)

    def test_a_moved_shared_grad_the_param_dropped_since_is_not_read(self):
        # The shared grad object moved to a tensor that cannot be the
        # param's grad (p.grad.data = a float64 copy), then dropped by the
        # param (default zero_grad: set to None; backward makes a new one):
        # the param's own grad steps; the stale object only goes back to
        # its span, with no error at this step or any later one.
        def changes(step, ps, grads, opt):
            if step == 1 and opt is not None:
                w = ps["w_tp0"]
                stale = w.grad
                stale.data = stale.data.double()
                w.grad = grads["w_tp0"].clone()  # the param's grad now, not the stale one

        opt = self.zero_copy_steps(changes, steps=4)
        for p, grad in opt._grads:
            self.assertIs(p.grad, grad)

    def test_a_grad_relaid_in_place_is_stepped_with_the_values_it_holds(self):
        # The shared grad object itself re-strided in place (as_strided_,
        # t_() on a square grad): the same object at the same address, so
        # the object and address tests passed it, and the daemons read its
        # span row-major. Its values go back into its span as laid out at
        # registration.
        def changes(step, ps, grads, opt):
            if step == 1 and opt is not None:  # the reference keeps its grad as it is
                w = ps["w_tp0"]
                with torch.no_grad():
                    w.grad.as_strided_((8, 6), (1, 8))  # column-major over its span
                    w.grad.copy_(grads["w_tp0"])

        opt = self.zero_copy_steps(changes)
        for p, grad in opt._grads:
            self.assertIs(p.grad, grad)
            self.assertTrue(grad.is_contiguous())

    def test_a_param_relaid_at_its_own_address_is_followed(self):
        # p.data set to a view of the param's own shared memory with the
        # same shape but other strides (the values column-major): the same
        # address, so the address test passed it, and the daemons stepped
        # the row-major memory as the param. It is followed as any rebound
        # param: its values copied into its span, p.data its view again.
        def changes(step, ps, grads, opt):
            if step == 1 and opt is not None:  # the reference keeps the values as they are
                w = ps["w_tp0"]
                with torch.no_grad():
                    values = w.detach().clone()
                    relaid = w.data.view(6, 8).t()  # (8, 6) at the same address, strides (1, 8)
                    relaid.copy_(values)
                w.data = relaid

        opt = self.zero_copy_steps(changes)
        w, view = next((p, v) for p, v, _ in opt._views if p.shape == (8, 6))
        self.assertEqual(w.data_ptr(), view.data_ptr())
        self.assertEqual(w.stride(), view.stride())

    def test_live_momentum_nesterov_and_betas_reach_the_daemons(self):
        def schedule(step, opt):
            opt.param_groups[0]["momentum"] = 0.85 + 0.03 * step  # momentum warm-up
            opt.param_groups[0]["nesterov"] = step % 2 == 0
            opt.param_groups[1]["betas"] = (0.8 + 0.05 * step, 0.9 + 0.02 * step)
            opt.param_groups[1]["eps"] = 1e-8 * (step + 1)
            opt.param_groups[1]["weight_decay"] = 0.01 * step

        ref_params, params = make_params(), make_params()
        want = train(ReferenceMuon(groups(ref_params), **HYPER), ref_params, schedule=schedule)
        got = train(self.muon(params), params, schedule=schedule)
        self.assert_same(got, want)
        last = {o.group: o for d in self.cluster.daemons for o in d.step_requests[-1].overrides}
        self.assertAlmostEqual(last["group0"].momentum, 0.94)
        self.assertFalse(last["group0"].nesterov)

    def test_changing_a_registration_time_entry_is_refused_before_any_copy(self):
        params = make_params()
        opt = self.muon(params)
        for gi, key, value in [(0, "ns_steps", 7), (0, "eps", 1e-6), (0, "scale_mode", "x"),
                               (1, "momentum", 0.5), (0, "fp32_matmul_prec", "highest")]:
            before = opt.param_groups[gi][key]
            opt.param_groups[gi][key] = value
            for p in params.values():
                p.grad = torch.ones_like(p)
            with self.subTest(key=key):
                with self.assertRaisesRegex(ValueError, rf"param group {gi} .*'{key}' changed"):
                    opt.step()
                # Each daemon heard only the refusal (its peers would fail the
                # step with it rather than wait): no Step that applies.
                for d in self.cluster.daemons:
                    last = d.step_requests[-1]
                    self.assertRegex(last.trainer_refusal, rf"ValueError: .*'{key}' changed")
                    self.assertEqual(last.step_id, 1)
                    self.assertTrue(all(r.trainer_refusal for r in d.step_requests))
            opt.param_groups[gi][key] = before
        opt.step()  # restored: steps
        self.assertEqual(opt.step_id, 1)

    def test_a_param_moved_between_groups_or_dropped_is_refused_naming_it(self):
        # muond steps each param with the group it was registered in: a param
        # moved to another group, or dropped from param_groups, would go on
        # being stepped with its old group's settings. Refused on every rank.
        params = make_params()
        opt = self.muon(params)
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()  # the lists have passed once (the fast path's cache)
        g0, g1 = opt.param_groups
        kept = [(list(g["params"]), list(g["param_names"])) for g in (g0, g1)]

        def restore():
            for g, (ps, names) in zip((g0, g1), kept):
                g["params"][:], g["param_names"][:] = ps, names

        i = g0["param_names"].index("w_solo")
        g1["params"].append(g0["params"].pop(i))
        g1["param_names"].append(g0["param_names"].pop(i))
        with self.assertRaisesRegex(ValueError, r"param group 0: .*gone from it: w_solo"):
            opt.step()
        for d in self.cluster.daemons:
            self.assertRegex(d.step_requests[-1].trainer_refusal, "w_solo")
        restore()
        g0["params"][i], g1["params"][0] = g1["params"][0], g0["params"][i]  # same lengths
        g0["param_names"][i], g1["param_names"][0] = g1["param_names"][0], g0["param_names"][i]
        with self.assertRaisesRegex(ValueError, r"param group 0: .*registered in another group: emb"):
            opt.step()
        restore()
        g0["params"].pop(i)
        g0["param_names"].pop(i)
        with self.assertRaisesRegex(ValueError, r"param group 0: .*gone from it: w_solo"):
            opt.step()
        restore()
        for dropped in (1, 0):  # the first one too: not read as the other's entries
            opt.param_groups.pop(dropped)
            with self.assertRaisesRegex(ValueError,
                                        r"param_groups has 1 groups and 2 were registered"):
                opt.step()
            opt.param_groups.insert(dropped, (g0, g1)[dropped])
        opt.step()  # as registered again: steps
        self.assertEqual(opt.step_id, 2)

    def test_a_foreign_param_past_the_named_ones_is_refused_naming_its_place(self):
        params = make_params()
        opt = self.muon(params)
        opt.zero_grad(set_to_none=False)
        opt.step()
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(4, 4)))
        with self.assertRaisesRegex(ValueError, r"param #5 of param group 0: not the tensor "
                                                r"registered in its place"):
            opt.step()
        opt.param_groups[0]["params"].pop()
        opt.step()  # as registered again: steps
        self.assertEqual(opt.step_id, 2)

    def test_params_that_are_not_a_list_are_refused_naming_the_group(self):
        params = make_params()
        opt = self.muon(params)
        kept = opt.param_groups[1]["params"]
        opt.param_groups[1]["params"] = (p for p in kept)
        for p in params.values():
            p.grad = torch.ones_like(p)
        with self.assertRaisesRegex(TypeError, r"param group 1: 'params' must be a list or tuple"):
            opt.step()
        for d in self.cluster.daemons:
            self.assertRegex(d.step_requests[-1].trainer_refusal, r"TypeError: param group 1")
        opt.param_groups[1]["params"] = tuple(kept)  # a tuple of the same tensors steps
        opt.step()
        self.assertEqual(opt.step_id, 1)

    def test_assigned_state_that_does_not_fit_is_refused_on_every_rank(self):
        # The state check runs in step() (push_if_assigned) before the Step:
        # without the refusal the peers' step() would wait for this rank.
        params = make_params()
        opt = self.muon(params)
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
        p0 = params["w_pad_tp1"]
        kept = opt.state[p0]["momentum_buffer"].clone()
        opt.state[p0]["momentum_buffer"] = torch.zeros(3)
        with self.assertRaisesRegex(ValueError, r"w_pad_tp1: state\['momentum_buffer'\] has shape"):
            opt.step()
        for d in self.cluster.daemons:
            last = d.step_requests[-1]
            self.assertEqual(last.step_id, 2)
            self.assertRegex(last.trainer_refusal, r"ValueError: param w_pad_tp1: state")
        self.assertEqual(opt.step_id, 1)
        opt.state[p0]["momentum_buffer"] = kept
        opt.step()
        self.assertEqual(opt.step_id, 2)
        self.assertFalse(self.cluster.daemons[0].step_requests[-1].trainer_refusal)

    def test_the_refusal_never_replaces_the_trainers_error(self):
        # Any error before the Step is sent is the refusal (a bug's KeyError
        # too: the peers must not wait), raised unchanged: a message that is
        # not valid UTF-8 or is huge is sent escaped and cut, never raising
        # an error of its own in place of the trainer's.
        params = make_params()
        opt = self.muon(params)
        for p in params.values():
            p.grad = torch.ones_like(p)
        for error in (ValueError("group 'g\udc80' " + "x" * 100_000), KeyError("bug")):
            def check(error=error):
                raise error
            opt._check_registered_groups = check
            with self.subTest(error=type(error).__name__):
                with self.assertRaises(Exception) as raised:
                    opt.step()
                self.assertTrue(raised.exception is error,
                                f"{type(raised.exception).__name__} raised instead")
                for d in self.cluster.daemons:
                    why = d.step_requests[-1].trainer_refusal
                    self.assertTrue(why.startswith(type(error).__name__), why[:80])
                    self.assertLess(len(why), 8192)
        del opt._check_registered_groups
        opt.step()
        self.assertEqual(opt.step_id, 1)

    def test_unsupported_adamw_options_are_refused_at_construction(self):
        for option in ({"amsgrad": True}, {"maximize": True}, {"differentiable": True},
                       {"capturable": True}, {"decoupled_weight_decay": False}):
            params = make_params()
            gs = groups(params)
            gs[1].update(option)
            with self.subTest(option=option):
                with self.assertRaisesRegex(ValueError, f"param group 1: AdamW option "
                                            f"{next(iter(option))}"):
                    Muon(gs, daemons=self.addresses, job_id="refuse", gtp_size=2, tp_size=1)
        params = make_params()
        gs = groups(params)
        gs[1].update(amsgrad=False, foreach=True, fused=False)  # accepted: same math
        self.muon_with_groups = Muon(gs, daemons=self.addresses, job_id="ok", gtp_size=2,
                                     tp_size=1)
        self.muon_with_groups.close()

    def test_momentum_schedulers_pick_torchs_key(self):
        # OneCycleLR cycles "momentum" for torch.optim.Muon and "betas" for
        # torch.optim.AdamW: it decides by the optimizer's defaults.
        w = torch.nn.Parameter(torch.randn(6, 4))
        b = torch.nn.Parameter(torch.randn(6))
        with Muon([w], daemons=self.addresses, job_id="m", gtp_size=2, tp_size=1) as muon:
            self.assertNotIn("betas", muon.defaults)
        with Muon([{"params": [b], "algorithm": "adamw"}], daemons=self.addresses, job_id="a",
                  gtp_size=2, tp_size=1) as adamw:
            self.assertIn("betas", adamw.defaults)


def _mutations():
    """(what, change(opt)) after a step passed: each is one thing a trainer
    may do to param_groups between steps, allowed or not."""
    def setter(gi, key, value):
        return lambda opt: opt.param_groups[gi].__setitem__(key, value)

    def swap_param(opt):
        opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.zeros(8, 6))

    def replace_group(opt):
        opt.param_groups[0] = dict(opt.param_groups[0])

    return [
        ("a new lr", setter(0, "lr", 0.5)),
        ("a new momentum", setter(0, "momentum", 0.8)),
        ("a numpy momentum", setter(0, "momentum", np.float64(0.8))),
        ("an lr as str", setter(0, "lr", "0.1")),
        ("a NaN lr", setter(0, "lr", float("nan"))),
        ("an inf weight_decay", setter(0, "weight_decay", float("inf"))),
        ("a bool lr", setter(0, "lr", True)),
        ("nesterov as a float", setter(0, "nesterov", 1.0)),
        ("a changed fixed entry", setter(0, "ns_steps", 7)),
        ("an equal fixed entry of another object", setter(0, "eps", float("1e-15"))),
        ("a fixed entry removed", lambda opt: opt.param_groups[0].pop("scale_mode")),
        ("custom_coefficients appended to",
         lambda opt: opt.param_groups[0]["custom_coefficients"].append((3.0, -4.0, 2.0))),
        ("custom_coefficients, an equal new list", setter(0, "custom_coefficients", [])),
        ("three betas", setter(1, "betas", (0.9, 0.99, 0.5))),
        ("betas as a list", setter(1, "betas", [0.9, 0.99])),
        ("an AdamW eps as str", setter(1, "eps", "1e-8")),
        ("params as a generator",
         lambda opt: opt.param_groups[0].__setitem__(
             "params", (p for p in opt.param_groups[0]["params"]))),
        ("params as a set",
         lambda opt: opt.param_groups[1].__setitem__("params",
                                                     set(opt.param_groups[1]["params"]))),
        ("params, an equal new list",
         lambda opt: opt.param_groups[0].__setitem__("params",
                                                     list(opt.param_groups[0]["params"]))),
        ("a param replaced", swap_param),
        ("a param appended",
         lambda opt: opt.param_groups[0]["params"].append(opt.param_groups[1]["params"][0])),
        ("two params swapped in place", lambda opt: opt.param_groups[0]["params"].reverse()),
        ("a group dict replaced by a copy", replace_group),
        ("a group removed", lambda opt: opt.param_groups.pop(1)),
        ("a grad replaced", lambda opt: setattr(opt.param_groups[0]["params"][0], "grad",
                                                torch.ones(9, 8))),
        ("custom_coefficients, an equal UserList",
         lambda opt: opt.param_groups[0].__setitem__(
             "custom_coefficients",
             collections.UserList(opt.param_groups[0]["custom_coefficients"]))),
        ("betas as a generator",
         lambda opt: opt.param_groups[1].__setitem__("betas", (b for b in (0.9, 0.99)))),
    ]


class UnchangedGroupsTest(unittest.TestCase):
    """The per-step fast path (groups.UnchangedGroups: the groups hold exactly
    what the last check passed) refuses and passes what the per-group check
    (groups.check_before_step) refuses and passes, with the same error, for
    every change a trainer may make between steps."""

    def setUp(self):
        d = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        self.cluster, self.addresses = start_cluster(d, 2)
        self.addCleanup(lambda: [x.stop() for x in self.cluster.daemons])

    def stepped_once(self, **kw):
        params = make_params()
        opt = Muon(groups(params), daemons=self.addresses, job_id="unchanged", gtp_size=2,
                   tp_size=1, **(HYPER | kw))
        self.addCleanup(opt.close)
        opt.zero_grad(set_to_none=False)
        opt.step()
        return opt

    @staticmethod
    def per_group_verdict(opt):
        """check_before_step's answer alone (no cache of any kind)."""
        in_place = opt._memory.grads_in_place()
        try:
            muond_groups.check_before_step(opt.param_groups, opt._fixed, opt._param_names,
                                           None, opt._memory.rebound_ids, in_place,
                                           opt._group_params)
        except Exception as e:  # noqa: BLE001 (compared with the step's)
            return type(e), str(e)
        return None

    def assert_step_answers_as_the_per_group_check(self, opt):
        want = self.per_group_verdict(opt)
        try:
            opt.step()
            got = None
        except Exception as e:  # noqa: BLE001 (compared with the check's)
            got = type(e), str(e)
        self.assertEqual(got, want)

    def test_the_fast_path_is_taken_for_an_unchanged_step(self):
        opt = self.stepped_once()
        checked = (opt.param_groups, opt._fixed, opt._param_names,
                   opt._memory.rebound_ids, True, opt._group_params)
        self.assertTrue(opt._unchanged_groups.holds(*checked))
        opt.param_groups[0]["lr"] = 0.3  # a scheduler's step keeps it
        self.assertTrue(opt._unchanged_groups.holds(*checked))

    def test_every_change_gets_the_per_group_checks_answer(self):
        for what, change in _mutations():
            with self.subTest(what):
                opt = self.stepped_once()
                change(opt)
                self.assert_step_answers_as_the_per_group_check(opt)

    def test_a_change_after_a_passing_change_gets_the_per_group_checks_answer(self):
        # The first change passes check_before_step (the fast path records
        # what it passed); the second must still get its answer.
        for what, first, then in _changes_after_a_passing_change():
            with self.subTest(what):
                opt = self.stepped_once(coefficient_type="simple")
                first(opt)
                self.assertIsNone(self.per_group_verdict(opt))
                opt.step()
                then(opt)
                self.assert_step_answers_as_the_per_group_check(opt)


def _changes_after_a_passing_change():
    """(what, a change check_before_step passes, a change after it): a value
    equal to the registered one, then edited in place."""
    def as_list(key):
        return lambda opt: opt.param_groups[0].__setitem__(key, list(opt.param_groups[0][key]))

    def first_item(key, value):
        return lambda opt: opt.param_groups[0][key].__setitem__(0, value)

    return [
        ("ns_coefficients as an equal list, then edited in place",
         as_list("ns_coefficients"), first_item("ns_coefficients", 99.0)),
        ("ns_coefficients as an equal list, then appended to", as_list("ns_coefficients"),
         lambda opt: opt.param_groups[0]["ns_coefficients"].append(1.0)),
        ("custom_coefficients, an equal new list, then edited in place",
         lambda opt: opt.param_groups[0].__setitem__("custom_coefficients", []),
         lambda opt: opt.param_groups[0]["custom_coefficients"].append(1.0)),
        ("an equal fixed entry of another object, then a new value",
         lambda opt: opt.param_groups[0].__setitem__("eps", float("1e-15")),
         lambda opt: opt.param_groups[0].__setitem__("eps", 1e-10)),
    ]


if __name__ == "__main__":
    unittest.main()
