"""muond.torch.Muon's optimizer state through fake daemons (fake_daemon.py):
state_dict / load_state_dict in torch.optim's format, ``opt.state``, the
all-or-nothing import, rebinding and pickling. The fake keeps the state per
local shard as the wire says, so split-mode assembly is checked against the
example's in-process ReferenceMuon (torch.optim's state layout) bitwise."""
import copy
import glob
import io
import os
import shutil
import sys
import tempfile
import unittest
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import start_cluster  # noqa: E402
from test_muon_fake_daemon import HYPER, PARAMS, groups, make_params  # noqa: E402
from muond.shm import SHM_DIR  # noqa: E402
from muond.torch import AddParamGroupError, Muon  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from reference_muon import ReferenceMuon  # noqa: E402
from torch_ns_fp32 import torch_muon_ns_in_fp32  # noqa: E402


def torch_ns_in_fp32():
    """torch.optim.Muon with its NS in fp32 (torch_ns_fp32), so it compares
    with muond's "highest" to fp32 rounding."""
    return torch_muon_ns_in_fp32()


def grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in params.items()}


def train(opt, params, seeds):
    for seed in seeds:
        for n, gr in grads(params, seed).items():
            params[n].grad = gr.to(params[n].dtype)
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


class StateTest(unittest.TestCase):
    G, T = 2, 2

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-state-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.clusters = []

    def tearDown(self):
        for cluster in self.clusters:
            for d in cluster.daemons:
                d.stop()

    def optimizer(self, params, world=None, **kw):
        world = world or self.G * self.T
        cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), world)
        self.clusters.append(cluster)
        opt = Muon(groups(params), daemons=addresses, job_id="state", gtp_size=self.G,
                   tp_size=world // self.G, **HYPER, **kw)
        self.addCleanup(opt.close)
        return opt, cluster

    def test_state_dict_is_torchs_state_of_the_reference(self):
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        train(ref, ref_params, [1, 2])
        params = make_params()
        opt, _ = self.optimizer(params)
        self.assertTrue(opt.state)  # truthy before any step: DCP must not step us
        train(opt, params, [1, 2])
        sd = opt.state_dict()
        want = ref.state_dict()
        self.assertEqual(sorted(sd["state"]), sorted(want["state"]))
        for i, name in enumerate([n for n, v in PARAMS.items() if v[2] == "muon"] +
                                 [n for n, v in PARAMS.items() if v[2] == "adamw"]):
            got, ref_state = sd["state"][i], want["state"][i]
            self.assertEqual(sorted(got), sorted(ref_state), name)
            for key, value in ref_state.items():
                value = torch.as_tensor(value, dtype=torch.float32)
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=name + key)
                self.assertEqual(got[key].dtype, torch.float32)
        self.assertEqual([g["muond_step_id"] for g in sd["param_groups"]], [2, 2])
        # opt.state reads the same, keyed by param as torch's.
        w = params["w_pad_tp1"]
        torch.testing.assert_close(opt.state[w]["momentum_buffer"], sd["state"][0]["momentum_buffer"],
                                   rtol=0, atol=0)
        self.assertEqual(len(list(opt.state.items())), len(PARAMS))

    def test_resume_through_torch_save_into_a_new_optimizer_is_bitwise(self):
        params = make_params()
        opt, _ = self.optimizer(params)
        train(opt, params, [1, 2])
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        snapshot = {n: p.detach().clone() for n, p in params.items()}
        want = train(opt, params, [3, 4])

        resumed = {n: torch.nn.Parameter(v.clone()) for n, v in snapshot.items()}
        for name, p in make_params().items():  # the Megatron tags
            resumed[name].__dict__.update(p.__dict__)
        opt2, _ = self.optimizer(resumed)
        buf.seek(0)
        opt2.load_state_dict(torch.load(buf, weights_only=True))
        self.assertEqual(opt2.step_id, 2)
        got = train(opt2, resumed, [3, 4])
        self.assertEqual(opt2.step_id, 4)
        for name in PARAMS:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_local_mode_state_is_torchs_and_resumes_bitwise(self):
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        runs = []
        for resume in (False, True):
            params = make_params()
            cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 1)
            self.clusters.append(cluster)
            opt = Muon(groups(params), daemons=addresses, job_id="state", shard_mode="local",
                       **HYPER)
            self.addCleanup(opt.close)
            if resume:
                with torch.no_grad():
                    for name, p in params.items():
                        p.copy_(snapshot[name])
                opt.load_state_dict(sd)
                runs.append(train(opt, params, [3]))
                continue
            train(opt, params, [1, 2])
            sd = opt.state_dict()
            snapshot = {n: p.detach().clone() for n, p in params.items()}
            runs.append(train(opt, params, [3]))
            opt.close()
        train(ref, ref_params, [1, 2])
        want_state = ref.state_dict()["state"]
        for i, state in want_state.items():
            for key, value in state.items():
                torch.testing.assert_close(sd["state"][i][key],
                                           torch.as_tensor(value, dtype=torch.float32),
                                           rtol=0, atol=0)
        for name in PARAMS:
            torch.testing.assert_close(runs[1][name], runs[0][name], rtol=0, atol=0, msg=name)

    def test_bad_state_dicts_are_refused_naming_the_param_and_change_nothing(self):
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(opt, params, [1])
        good = opt.state_dict()
        before = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in good["state"].items()}
        bad_cases = []
        sd = opt.state_dict()
        sd["state"][1]["momentum_buffer"] = torch.zeros(3, 3)
        bad_cases.append((sd, r"param w_tp0: state\['momentum_buffer'\] has shape"))
        sd = opt.state_dict()
        del sd["state"][5]["exp_avg_sq"]
        bad_cases.append((sd, "param emb: state has keys"))
        sd = opt.state_dict()
        sd["state"][6]["max_exp_avg_sq"] = torch.zeros(9)
        bad_cases.append((sd, r"param bias: state keys \['max_exp_avg_sq'\]"))
        sd = opt.state_dict()
        sd["state"][0]["momentum_buffer"][0, 0] = float("nan")
        bad_cases.append((sd, "param w_pad_tp1: .* non-finite"))
        sd = opt.state_dict()
        sd["param_groups"][0]["ns_steps"] = 3  # fixed at registration
        bad_cases.append((sd, "param group 0 .*'ns_steps' is 3 in the state dict"))
        sd = opt.state_dict()
        sd["param_groups"] = sd["param_groups"][:1]
        bad_cases.append((sd, "1 parameter groups"))
        for sd, message in bad_cases:
            sd["param_groups"][0]["lr"] = 123.0
            for g in sd["param_groups"]:
                g["muond_step_id"] = 77
            with self.assertRaisesRegex(ValueError, message):
                opt.load_state_dict(sd)
        # A daemon that refuses its part: every staged part is dropped.
        cluster.daemons[3].refuse_import = "entry refused by the test"
        sd = opt.state_dict()
        sd["state"][0]["momentum_buffer"].add_(1.0)
        sd["param_groups"][0]["muond_step_id"] = sd["param_groups"][1]["muond_step_id"] = 77
        with self.assertRaisesRegex(RuntimeError, "ImportState failed.*refused by the test"):
            opt.load_state_dict(sd)
        self.assertTrue(all(not d.staged for d in cluster.daemons))
        self.assertEqual(opt.step_id, 1)
        self.assertNotEqual(opt.param_groups[0]["lr"], 123.0)
        after = opt.state_dict()["state"]
        for i, state in before.items():
            for key, value in state.items():
                torch.testing.assert_close(after[i][key], value, rtol=0, atol=0)

    def test_loads_a_torch_optim_muon_state_dict_in_bf16(self):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8, 6))
        torch_w = torch.nn.Parameter(w.detach().to(torch.bfloat16))
        reference = torch.optim.Muon([torch_w], lr=0.02)
        torch_w.grad = torch.randn(8, 6).to(torch.bfloat16)
        reference.step()
        sd = reference.state_dict()
        self.assertEqual(sd["state"][0]["momentum_buffer"].dtype, torch.bfloat16)
        cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 2)
        self.clusters.append(cluster)
        opt = Muon([w], daemons=addresses, job_id="state", gtp_size=2, first_step_id=5)
        self.addCleanup(opt.close)
        opt.load_state_dict(sd)
        self.assertEqual(opt.step_id, 4)  # no muond step id: kept
        torch.testing.assert_close(opt.state[w]["momentum_buffer"],
                                   sd["state"][0]["momentum_buffer"].float(), rtol=0, atol=0)
        self.assertEqual(opt.param_groups[0]["algorithm"], "muon")  # our options stay
        w.grad = torch.randn(8, 6)
        opt.step()
        self.assertEqual(opt.step_id, 5)

    def test_loads_a_torch_optim_adamw_state_dict_and_continues_as_torch(self):
        torch.manual_seed(1)
        start = torch.randn(9)
        hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
        reference_p = torch.nn.Parameter(start.clone())
        reference = torch.optim.AdamW([reference_p], **hyper)
        gen = torch.Generator().manual_seed(2)
        grads = [torch.randn(9, generator=gen) for _ in range(3)]
        for g in grads[:2]:
            reference_p.grad = g.clone()
            reference.step()
        sd = reference.state_dict()
        p = torch.nn.Parameter(reference_p.detach().clone())
        cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 1)
        self.clusters.append(cluster)
        opt = Muon([{"params": [p], "algorithm": "adamw", **hyper}], daemons=addresses,
                   job_id="state")
        self.addCleanup(opt.close)
        opt.load_state_dict(sd)
        self.assertEqual(float(opt.state[p]["step"]), 2.0)
        for o, q in ((reference, reference_p), (opt, p)):
            q.grad = grads[2].clone()
            o.step()
        # Step 3 from torch's moments and count (from zero it would differ ~1e-2).
        torch.testing.assert_close(p.detach(), reference_p.detach(), rtol=1e-6, atol=1e-7)

    def test_assigned_state_reaches_the_daemons(self):
        # Lightning's _optimizer_to_device writes every entry back; torch.optim
        # then steps from what was written.
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        params = make_params()
        opt, cluster = self.optimizer(params)
        for o, ps in ((ref, ref_params), (opt, params)):
            train(o, ps, [1])
            for p, value in list(o.state.items()):
                o.state[p] = {k: v * 2 for k, v in value.items()}
        imports = sum(d.imports for d in cluster.daemons)
        want = train(ref, ref_params, [2])
        got = train(opt, params, [2])
        self.assertEqual(sum(d.imports for d in cluster.daemons), imports + 4)
        for name in PARAMS:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_rebound_params_are_followed_or_refused_before_any_rpc(self):
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(ref, ref_params, [1])
        train(opt, params, [1])
        new = torch.randn(params["w_tp0"].shape)
        ref_params["w_tp0"].data = new.clone()
        params["w_tp0"].data = new.clone()  # same shape/dtype/device: followed
        want = train(ref, ref_params, [2])
        got = train(opt, params, [2])
        for name in PARAMS:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        steps = [d.last_step for d in cluster.daemons]
        params["w_solo"].data = params["w_solo"].data.half()
        with self.assertRaisesRegex(ValueError, r"param w_solo: dtype torch.float32 -> "
                                                r"torch.float16"):
            train(opt, params, [3])
        self.assertEqual([d.last_step for d in cluster.daemons], steps)
        self.assertEqual(opt.step_id, 2)

    def _two_steps_beside_the_reference(self):
        """(ref, ref_params, opt, params, cluster) after steps 1 and 2 on both."""
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(ref, ref_params, [1, 2])
        train(opt, params, [1, 2])
        return ref, ref_params, opt, params, cluster

    def test_add_param_group_mid_run_equals_the_reference(self):
        ref, ref_params, opt, params, cluster = self._two_steps_beside_the_reference()
        late = torch.randn(10, 6, generator=torch.Generator().manual_seed(5))
        for o, ps in ((ref, ref_params), (opt, params)):
            ps["late"] = torch.nn.Parameter(late.clone())
            ps["late_bias"] = torch.nn.Parameter(late[0].clone())
            o.add_param_group({"params": [ps["late"]], "param_names": ["late"]})
            o.add_param_group({"params": [ps["late_bias"]], "param_names": ["late_bias"],
                               "algorithm": "adamw", "lr": 0.01, "betas": (0.9, 0.99),
                               "eps": 1e-8, "weight_decay": 0.05})
        self.assertEqual(opt.step_id, 2)
        self.assertIn("late", opt.layouts)
        want = train(ref, ref_params, [3, 4])
        got = train(opt, params, [3, 4])
        self.assertEqual(opt.step_id, 4)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(opt.state[params["late_bias"]]["step"], torch.tensor(2.0))

    def test_an_added_adamw_group_takes_the_constructors_betas_and_eps(self):
        # With Muon groups the optimizer's defaults are a Muon group's (no
        # betas): an AdamW group added without betas and eps gets the
        # constructor's, as one given at construction does.
        adamw = dict(betas=(0.8, 0.9), adamw_eps=1e-6)
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER, **adamw)
        params = make_params()
        opt, _ = self.optimizer(params, **adamw)
        train(ref, ref_params, [1])
        train(opt, params, [1])
        late = torch.randn(7, generator=torch.Generator().manual_seed(6))
        for o, ps, extra in ((ref, ref_params, dict(betas=(0.8, 0.9), eps=1e-6)),
                             (opt, params, {})):
            ps["late_bias"] = torch.nn.Parameter(late.clone())
            o.add_param_group({"params": [ps["late_bias"]], "param_names": ["late_bias"],
                               "algorithm": "adamw", **extra})
        self.assertEqual((opt.param_groups[-1]["betas"], opt.param_groups[-1]["eps"]),
                         ((0.8, 0.9), 1e-6))
        want = train(ref, ref_params, [2, 3])
        got = train(opt, params, [2, 3])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_add_param_group_mid_run_equals_torch_optim_muon_in_fp32(self):
        # torch runs NS in bf16: make its one cast an fp32 copy (as
        # tests/core/muon/peer_oracle_test.py does); muond runs fp32 "highest".
        gen = torch.Generator().manual_seed(9)
        first, late = torch.randn(8, 6, generator=gen), torch.randn(6, 10, generator=gen)
        settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 2)
        self.clusters.append(cluster)
        results = []
        for make in (lambda ps: torch.optim.Muon(ps, **settings),
                     lambda ps: Muon(ps, daemons=addresses, job_id="state", gtp_size=2,
                                     fp32_matmul_prec="highest", **settings)):
            ps = {"first": torch.nn.Parameter(first.clone())}
            opt = make([ps["first"]])
            try:
                with torch_ns_in_fp32():
                    train(opt, ps, [1, 2])
                    ps["late"] = torch.nn.Parameter(late.clone())
                    opt.add_param_group({"params": [ps["late"]]})
                    results.append(train(opt, ps, [3, 4]))
            finally:
                if isinstance(opt, Muon):
                    opt.close()
        for name in results[0]:
            torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5,
                                       atol=1e-6, msg=name)

    def test_distributed_checkpoint_state_dict_keeps_state_and_step_id(self):
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        def model_and_optimizer():
            torch.manual_seed(4)
            model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False),
                                        torch.nn.Linear(8, 4))
            cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 2)
            self.clusters.append(cluster)
            opt = Muon([{"params": [model[0].weight, model[1].weight]},
                        {"params": [model[1].bias], "algorithm": "adamw", "lr": 0.01}],
                       daemons=addresses, job_id="dcp", gtp_size=2)
            self.addCleanup(opt.close)
            return model, opt, cluster

        model, opt, cluster = model_and_optimizer()
        for p in model.parameters():
            p.grad = None
        get_optimizer_state_dict(model, opt)  # its _init_optim_state must not step us
        self.assertEqual([d.last_step for d in cluster.daemons], [0, 0])
        for _ in range(2):
            model(torch.randn(3, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
        osd = get_optimizer_state_dict(model, opt)
        self.assertEqual([g["muond_step_id"] for g in osd["param_groups"]], [2, 2])
        model2, opt2, _ = model_and_optimizer()
        set_optimizer_state_dict(model2, opt2, osd)
        self.assertEqual(opt2.step_id, 2)
        for p, p2 in zip(model.parameters(), model2.parameters()):
            for key, value in opt.state[p].items():
                torch.testing.assert_close(opt2.state[p2][key], value, rtol=0, atol=0)

    def test_pickling_is_refused_at_save_time_naming_state_dict(self):
        params = make_params()
        opt, _ = self.optimizer(params)
        with self.assertRaisesRegex(TypeError, r"opt.state_dict\(\)"):
            torch.save(opt, io.BytesIO())

    # -- add_param_group failure paths (bad groups, refusals, failed rollback) --
    def _late_group(self, ps, **extra):
        ps["late"] = torch.nn.Parameter(
            torch.randn(10, 6, generator=torch.Generator().manual_seed(5)))
        return dict(params=[ps["late"]], param_names=["late"], **extra)

    def test_a_bad_new_group_is_refused_before_any_rpc(self):
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(opt, params, [1])
        before = [(len(d.requests), d.imports, len(d.groups)) for d in cluster.daemons]
        sd = opt.state_dict()
        bad = [
            ({"params": [torch.nn.Parameter(torch.zeros(5))], "param_names": ["v"]},
             r"param v: Muon params must be matrices \(2-D\)"),
            ({"params": [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))],
              "param_names": ["h"]}, r"param h: dtype torch.float64 not in \(float32, "
                                     r"bfloat16, float16\)"),
            ({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "param_names": ["w_tp0"]},
             r"param name 'w_tp0' appears twice"),
            ({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "param_names": ["q"],
              "name": "group0"},
             r"group name 'group0' is already a group's"),
            ({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "param_names": ["q"], "lr": "0.1"},
             r"param group 2 .*'lr' must be a finite real number"),
            ({"params": [torch.nn.Parameter(torch.zeros(4, 4))], "param_names": ["q"],
              "momentum": float("nan")},
             r"param group 2 .*'momentum' must be a finite real number"),
            ({"params": [torch.nn.Parameter(torch.zeros(4))], "param_names": ["q"],
              "algorithm": "adamw", "betas": (0.9,)}, r"param group 2 .*'betas' must be a pair"),
        ]
        for group, message in bad:
            with self.assertRaisesRegex(ValueError, message):
                opt.add_param_group(group)
            self.assertEqual(len(opt.param_groups), 2)
        self.assertEqual([(len(d.requests), d.imports, len(d.groups))
                          for d in cluster.daemons], before)
        after = opt.state_dict()["state"]
        for i, state in sd["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(after[i][key], value, rtol=0, atol=0)

    def test_add_param_group_registers_old_groups_as_last_registered(self):
        # A live value the daemons refuse (momentum=1.0, loaded or set) is
        # step()'s to name; add_param_group registers the old groups with the
        # values they were last registered with, so it neither fails on it nor
        # tears the registration down. A new group the daemons refuse is
        # rolled back and the optimizer runs on as the reference does.
        def refuse_momentum_one(request):
            bad = [g.name for g in request.groups
                   if g.algorithm == pb.ALGORITHM_MUON and g.muon.momentum >= 1]
            return f"group {bad}: momentum must be < 1" if bad else ""

        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        params = make_params()
        opt, cluster = self.optimizer(params)
        for d in cluster.daemons:
            d.refuse_register = refuse_momentum_one
        train(ref, ref_params, [1, 2])
        train(opt, params, [1, 2])
        sd = opt.state_dict()
        sd["param_groups"][0]["momentum"] = 1.0
        opt.load_state_dict(sd)  # finite: accepted; the bound is the daemon's
        with self.assertRaises(RuntimeError):
            opt.add_param_group(self._late_group({}, momentum=1.0))
        self.assertEqual(len(opt.param_groups), 2)
        for o, ps in ((ref, ref_params), (opt, params)):
            o.add_param_group(self._late_group(ps))
        self.assertFalse(opt._closed)
        opt.param_groups[0]["momentum"] = HYPER["momentum"]
        want = train(ref, ref_params, [3, 4])
        got = train(opt, params, [3, 4])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_add_param_group_refuses_a_changed_fixed_entry_as_step_does(self):
        # Registering again would apply the edit silently, and a refused
        # registration's rollback would register the edited groups as the
        # old ones: add_param_group raises step()'s error before any RPC, and
        # the optimizer runs on as the reference does.
        ref, ref_params, opt, params, cluster = self._two_steps_beside_the_reference()
        before = [(len(d.requests), d.imports, len(d.groups)) for d in cluster.daemons]
        for gi, key, value in ((0, "state_dtype", "fp8_e4m3"), (0, "ns_steps", 4),
                               (1, "state_location", "host")):
            with self.subTest(key=key):
                kept = opt.param_groups[gi][key]
                opt.param_groups[gi][key] = value
                with self.assertRaises(ValueError) as at_step:
                    opt.step()
                with self.assertRaises(ValueError) as at_add:
                    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5))],
                                         "param_names": ["late_bias"], "algorithm": "adamw",
                                         "betas": (0.9, 0.99)})
                self.assertRegex(str(at_add.exception),
                                 rf"param group {gi} .*'{key}' changed from {kept!r} to "
                                 rf"{value!r} after construction")
                self.assertEqual(str(at_add.exception), str(at_step.exception))
                self.assertEqual(len(opt.param_groups), 2)
                opt.param_groups[gi][key] = kept
        self.assertEqual([(len(d.requests), d.imports, len(d.groups))
                          for d in cluster.daemons], before)
        for o, ps in ((ref, ref_params), (opt, params)):
            o.add_param_group(self._late_group(ps))
        want = train(ref, ref_params, [3, 4])
        got = train(opt, params, [3, 4])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_add_param_group_hands_out_the_state_when_even_the_rollback_fails(self):
        ref_params = make_params()
        ref = ReferenceMuon(groups(ref_params), **HYPER)
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(ref, ref_params, [1, 2])
        train(opt, params, [1, 2])
        for d in cluster.daemons:
            d.refuse_register = lambda request: "fake: registration refused"
        with self.assertRaisesRegex(RuntimeError, r"load_state_dict\(error.state_dict\)") as cm:
            opt.add_param_group(self._late_group({}))
        self.assertIsInstance(cm.exception, AddParamGroupError)
        self.assertTrue(opt._closed)
        self.assertEqual([d.groups for d in cluster.daemons], [[]] * len(cluster.daemons))
        for d in cluster.daemons:
            d.refuse_register = None
        addresses = [d.address for d in cluster.daemons]
        opt2 = Muon(groups(params), daemons=addresses, job_id="state", gtp_size=self.G,
                    tp_size=self.T, **HYPER)
        self.addCleanup(opt2.close)
        opt2.load_state_dict(cm.exception.state_dict)
        self.assertEqual(opt2.step_id, 2)
        want = train(ref, ref_params, [3, 4])
        got = train(opt2, params, [3, 4])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_a_placement_refused_on_registering_again_leaves_no_shm_name(self):
        # The rollback registers the old groups again in fresh buffers: the
        # buffers of the registration before the refused one are released
        # too, or their names stay in /dev/shm after the trainer ends.
        params = make_params()
        before = set(glob.glob(f"{SHM_DIR}/muond-state-{os.getpid()}-*"))
        opt, _ = self.optimizer(params)
        train(opt, params, [1])
        place = opt._layout.place
        calls = []

        def refused_once(*args):
            calls.append(args)
            if len(calls) == 1:
                raise ValueError("fake: the placement refused the new groups")
            return place(*args)

        with mock.patch.object(opt._layout, "place", refused_once):
            with self.assertRaisesRegex(ValueError, "placement refused"):
                opt.add_param_group(self._late_group({}))
        self.assertEqual(len(calls), 2)  # refused, then the rollback's
        self.assertFalse(opt._closed)
        train(opt, params, [2])
        left = set(glob.glob(f"{SHM_DIR}/muond-state-{os.getpid()}-*")) - before
        self.assertEqual(left, {b.shm.path for b in opt._buffers})
        opt.close()
        self.assertEqual(set(glob.glob(f"{SHM_DIR}/muond-state-{os.getpid()}-*")) - before,
                         set())

    # -- opt.state edits reach the daemons --------------------------------
    def test_state_key_assignment_and_in_place_edits_reach_the_daemons(self):
        # torch.optim.Muon steps from whatever opt.state holds; so must we.
        # torch runs NS in bf16: its one cast made an fp32 copy, muond fp32.
        gen = torch.Generator().manual_seed(9)
        first, second = torch.randn(8, 6, generator=gen), torch.randn(6, 10, generator=gen)
        settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
        cluster, addresses = start_cluster(tempfile.mkdtemp(dir=self.dir), 2)
        self.clusters.append(cluster)
        results = []
        for make in (lambda ps: torch.optim.Muon(ps, **settings),
                     lambda ps: Muon(ps, daemons=addresses, job_id="state", gtp_size=2,
                                     fp32_matmul_prec="highest", **settings)):
            ps = {"first": torch.nn.Parameter(first.clone()),
                  "second": torch.nn.Parameter(second.clone())}
            opt = make(list(ps.values()))
            try:
                with torch_ns_in_fp32():
                    train(opt, ps, [1, 2])
                    opt.state[ps["first"]]["momentum_buffer"] = torch.full((8, 6), 0.25)
                    opt.state[ps["second"]]["momentum_buffer"].mul_(-3.0)
                    results.append(train(opt, ps, [3, 4]))
            finally:
                if isinstance(opt, Muon):
                    opt.close()
        for name in results[0]:
            torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5,
                                       atol=1e-6, msg=name)

    # -- load_state_dict checks of group entries ---------------------------
    def test_ill_typed_live_values_and_step_ids_are_refused_at_load(self):
        params = make_params()
        opt, cluster = self.optimizer(params)
        train(opt, params, [1])
        good = opt.state_dict()
        imports = sum(d.imports for d in cluster.daemons)

        def edited(group_key=None, value=None, step_id=None, meta=False):
            sd = copy.deepcopy(good)
            if group_key:
                sd["param_groups"][group_key[0]][group_key[1]] = value
            if step_id is not None:
                for g in sd["param_groups"]:
                    g["muond_step_id"] = step_id
            if meta:
                sd["state"][0]["momentum_buffer"] = torch.zeros(9, 8, device="meta")
            return sd

        cases = [
            (edited((0, "lr"), None), r"param group 0 .*'lr' must be a finite real number"),
            (edited((0, "lr"), float("nan")), r"param group 0 .*'lr' must be a finite"),
            (edited((0, "momentum"), "0.9"), r"param group 0 .*'momentum' must be"),
            (edited((1, "eps"), float("inf")), r"param group 1 .*'eps' must be a finite"),
            (edited((1, "betas"), (0.9, None)), r"param group 1 .*'betas' must be"),
            (edited((0, "nesterov"), "yes"), r"param group 0 .*'nesterov' must be a bool"),
            (edited(step_id=True), r"'muond_step_id' must be an int"),
            (edited(step_id=2.5), r"'muond_step_id' must be an int"),
            (edited(step_id="3"), r"'muond_step_id' must be an int"),
            (edited(step_id=2**63), r"'muond_step_id' must be an int"),
            (edited(step_id=-2), r"'muond_step_id' must be an int"),
            (edited(meta=True), r"param w_pad_tp1: state\['momentum_buffer'\] is on the meta"),
        ]
        for sd, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                opt.load_state_dict(sd)
        self.assertEqual(sum(d.imports for d in cluster.daemons), imports)
        self.assertEqual(opt.step_id, 1)
        self.assertEqual(opt.param_groups[0]["lr"], HYPER["lr"])
        opt.load_state_dict(edited(step_id=7.0))  # a whole float (json) is an id
        self.assertEqual(opt.step_id, 7)


if __name__ == "__main__":
    unittest.main()
