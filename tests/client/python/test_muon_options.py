"""muond.torch.Muon's two ways of giving options: the flat keywords and the
option objects (NewtonSchulzOptions, ScalingOptions, AdamWOptions,
StateStorageOptions, PlacementOptions, ConnectionOptions) give the same param_groups and the same
wire groups on every daemon (fake daemons, fake_daemon.py); a flat keyword
given together with its concern's object is refused naming the keyword."""
import os
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import FakeClusterTestCase  # noqa: E402 (puts client/python on sys.path)

from muond.torch import (AdamWOptions, ConnectionOptions, Muon,  # noqa: E402
                         NewtonSchulzOptions, PlacementOptions, ScalingOptions,
                         StateStorageOptions)
from muond.torch import groups as muond_groups  # noqa: E402
from muond.torch import options as muond_options  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402

# Every flat keyword with a value other than its default, by concern.
NS = dict(coefficient_type="quintic", ns_batch_size=2, fp32_matmul_prec="highest",
          use_syrk=True, ns_algorithm="gram", gram_restarts=[2], gram_dtype="bf16",
          gram_min_aspect_ratio=1.5)
SCALING = dict(scale_mode="spectral", extra_scale_factor=0.3, weight_decay_method="decoupled",
               variant="normuon", beta2=0.9, moment2_eps=1e-7)
ADAMW = dict(betas=(0.8, 0.9), adamw_eps=1e-6)
STATE = dict(state_dtype="bf16", state_location="host", double_buffer_momentum=True)
TORCH = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=False, eps=1e-8, ns_steps=6)


def make_groups():
    g = torch.Generator().manual_seed(5)
    muon = [torch.nn.Parameter(torch.randn(8, 6, generator=g)),
            torch.nn.Parameter(torch.randn(6, 7, generator=g))]
    adamw = [torch.nn.Parameter(torch.randn(5, generator=g))]
    return [dict(params=muon, param_names=["w0", "w1"]),
            dict(params=adamw, param_names=["b"], algorithm="adamw")]


def comparable_groups(opt):
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def wire_groups(daemons):
    """Per daemon, the wire groups of its last RegisterParams with each
    param's memory region left out (every optimizer has its own shm names)."""
    out = []
    for daemon in daemons:
        groups = []
        for group in daemon.requests[-1].groups:
            group = type(group).FromString(group.SerializeToString())
            for param in group.params:
                param.param.ClearField("region")
                param.grad.ClearField("region")
            groups.append(group.SerializeToString(deterministic=True))
        out.append(groups)
    return out


class MuonOptionObjectsTest(FakeClusterTestCase):
    world = 2

    def build(self, **kwargs):
        opt = Muon(make_groups(), **TORCH, **kwargs)
        self.addCleanup(opt.close)
        return opt

    def test_flat_keywords_and_option_objects_register_the_same_groups(self):
        flat = self.build(**NS, **SCALING, **ADAMW, **STATE, gtp_size=2, tp_size=1, domain_name="d",
                          daemons=self.addresses, job_id="fake", client_id="flat",
                          rpc_timeout=30.0, first_step_id=7)
        flat_wire = wire_groups(self.cluster.daemons)
        flat_groups = comparable_groups(flat)
        flat.close()
        objects = self.build(
            newton_schulz=NewtonSchulzOptions(**NS), scaling=ScalingOptions(**SCALING),
            adamw=AdamWOptions(betas=ADAMW["betas"], eps=ADAMW["adamw_eps"]),
            state_storage=StateStorageOptions(**STATE),
            placement=PlacementOptions(gtp_size=2, tp_size=1, domain_name="d"),
            connection=ConnectionOptions(daemons=self.addresses, job_id="fake",
                                         client_id="objects", rpc_timeout=30.0,
                                         first_step_id=7))
        self.assertEqual(comparable_groups(objects), flat_groups)
        self.assertEqual(wire_groups(self.cluster.daemons), flat_wire)
        self.assertEqual((objects.step_id, objects.gtp_size, objects.domain_name),
                         (flat.step_id, flat.gtp_size, flat.domain_name))
        self.assertEqual(objects.layouts.keys(), flat.layouts.keys())

    def test_default_objects_equal_no_options(self):
        plain = self.build(daemons=self.addresses[:1], job_id="fake", client_id="plain")
        plain_groups = comparable_groups(plain)
        plain_wire = wire_groups(self.cluster.daemons[:1])
        plain.close()
        objects = self.build(newton_schulz=NewtonSchulzOptions(), scaling=ScalingOptions(),
                             adamw=AdamWOptions(), state_storage=StateStorageOptions(),
                             placement=PlacementOptions(),
                             connection=ConnectionOptions(daemons=self.addresses[:1],
                                                          job_id="fake", client_id="objects"))
        self.assertEqual(comparable_groups(objects), plain_groups)
        self.assertEqual(wire_groups(self.cluster.daemons[:1]), plain_wire)

    def test_a_flat_keyword_with_its_object_is_refused_naming_it(self):
        cases = [
            (dict(ns_batch_size=2, newton_schulz=NewtonSchulzOptions()),
             "give ns_batch_size= or newton_schulz=NewtonSchulzOptions(ns_batch_size=...), "
             "not both"),
            (dict(scale_mode="spectral", scaling=ScalingOptions()),
             "give scale_mode= or scaling=ScalingOptions(scale_mode=...), not both"),
            (dict(adamw_eps=1e-6, adamw=AdamWOptions()),
             "give adamw_eps= or adamw=AdamWOptions(eps=...), not both"),
            (dict(state_location="host", state_storage=StateStorageOptions()),
             "give state_location= or state_storage=StateStorageOptions(state_location=...), "
             "not both"),
            (dict(gtp_size=2, placement=PlacementOptions()),
             "give gtp_size= or placement=PlacementOptions(gtp_size=...), not both"),
            (dict(daemons=self.addresses, connection=ConnectionOptions()),
             "give daemons= or connection=ConnectionOptions(daemons=...), not both"),
        ]
        for kwargs, message in cases:
            with self.subTest(message=message):
                with self.assertRaises(ValueError) as raised:
                    Muon(make_groups(), **kwargs)
                self.assertEqual(str(raised.exception), message)
        for daemon in self.cluster.daemons:
            self.assertEqual(daemon.requests, [])  # refused before any RPC

    def test_split_sizes_are_checked_as_given_not_truncated(self):
        # 1 x 2.9 is not the 2 daemons given, whatever int() would make of it.
        for sizes, message in [
                (dict(tp_size=2.9), "gtp_size x tp_size = 1 x 2.9 daemons, got 2"),
                (dict(gtp_size=2.5), "gtp_size x tp_size = 2.5 x 1 daemons, got 2"),
                (dict(placement=PlacementOptions(tp_size=2.9)),
                 "gtp_size x tp_size = 1 x 2.9 daemons, got 2")]:
            with self.subTest(sizes=sizes):
                with self.assertRaisesRegex(ValueError, message):
                    Muon(make_groups(), daemons=self.addresses, **sizes)
        for daemon in self.cluster.daemons:
            self.assertEqual(daemon.requests, [])  # refused before any RPC

    def test_unknown_keyword_and_wrong_object_are_type_errors(self):
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'ns_stepz'"):
            Muon(make_groups(), ns_stepz=5)
        with self.assertRaisesRegex(TypeError, "newton_schulz= must be a "
                                               "muond.torch.NewtonSchulzOptions"):
            Muon(make_groups(), newton_schulz=ScalingOptions())

    def test_every_flat_keyword_has_one_object_field(self):
        self.assertEqual(len(muond_options.FLAT_KEYWORDS), len(set(muond_options.FLAT_KEYWORDS)))
        self.assertIn("adamw_eps", muond_options.FLAT_KEYWORDS)
        self.assertEqual(len(muond_options.FLAT_KEYWORDS), 44)

class NsBatchSizeLoadTest(FakeClusterTestCase):
    """ns_batch_size schedules NS and is no part of the state: a state dict
    saved at 1 (every checkpoint from before auto batching) loads into an
    optimizer at the default (0, auto), and back; each keeps its own value,
    registered and stepped with it, and the momentum carries over."""

    def run_steps(self, opt, steps):
        for _ in range(steps):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.full_like(p, 0.1)
            opt.step()

    def test_a_state_dict_of_another_ns_batch_size_loads_both_ways(self):
        for saved_batch, loaded_batch in ((1, 0), (0, 1), (7, 0)):
            with self.subTest(saved=saved_batch, loaded=loaded_batch):
                src = Muon(make_groups(), **TORCH, ns_batch_size=saved_batch,
                           daemons=self.addresses, job_id="fake", client_id="src")
                self.run_steps(src, 2)
                saved = src.state_dict()
                momentum = saved["state"][0]["momentum_buffer"].clone()
                self.assertEqual(saved["param_groups"][0]["ns_batch_size"], saved_batch)
                src.close()
                dst = Muon(make_groups(), **TORCH, ns_batch_size=loaded_batch,
                           daemons=self.addresses, job_id="fake", client_id="dst")
                self.addCleanup(dst.close)
                dst.load_state_dict(saved)
                self.assertEqual(dst.step_id, 2)
                self.assertTrue(torch.equal(dst.state_dict()["state"][0]["momentum_buffer"],
                                            momentum))
                self.run_steps(dst, 1)  # fixed entries rechecked: nothing refused
                self.assertEqual(dst.step_id, 3)
                self.assertEqual([g["ns_batch_size"] for g in dst.param_groups],
                                 [loaded_batch, loaded_batch])
                muon_wire = [g for g in self.cluster.daemons[0].requests[-1].groups
                             if g.algorithm != pb.ALGORITHM_ADAMW]
                self.assertEqual({g.muon.ns_batch_size for g in muon_wire}, {loaded_batch})
                dst.close()

    def test_use_syrk_gives_way_too_and_a_math_option_does_not(self):
        opt = Muon(make_groups(), **TORCH, use_syrk=False, daemons=self.addresses,
                   job_id="fake")
        self.addCleanup(opt.close)
        group = opt.param_groups[0]
        live = {k: group[k] for k in muond_groups.LIVE_KEYS["muon"]}
        self.assertEqual(muond_groups.loaded_options(0, group, dict(group, use_syrk=True)),
                         live)
        # So does double_buffer_momentum (the same state either way).
        self.assertEqual(muond_groups.loaded_options(
            0, group, dict(group, double_buffer_momentum=True)), live)
        with self.assertRaisesRegex(ValueError, r"'ns_steps' is 5 in the state dict, 6 here"):
            muond_groups.loaded_options(0, group, dict(group, ns_steps=5))


class ArrayOptionsTest(FakeClusterTestCase):
    """A Muon group's numbers as numpy or one-element tensor values (a config
    loaded into arrays) register the same wire group as plain numbers, and
    steps pass the fixed-entry check (before: eps or extra_scale_factor as a
    numpy scalar array failed construction with protobuf's TypeError naming
    no group or key; custom_coefficients as an array or tensor with numpy's
    or torch's "ambiguous truth value")."""

    def build_wire(self, client_id, **group_options):
        g = torch.Generator().manual_seed(5)
        w = torch.nn.Parameter(torch.randn(8, 6, generator=g))
        opt = Muon([dict(params=[w], param_names=["w0"], coefficient_type="custom",
                         **group_options)],
                   daemons=self.addresses, job_id="fake", client_id=client_id)
        self.addCleanup(opt.close)
        for _ in range(2):
            w.grad = torch.full_like(w, 0.1)
            opt.step()
        opt.close()
        return wire_groups(self.cluster.daemons)

    def test_arrays_and_tensors_register_as_their_numbers(self):
        coefficients = [3.4445, -4.775, 2.0315]
        plain = self.build_wire("plain", eps=1e-7, extra_scale_factor=0.5, ns_steps=6,
                                custom_coefficients=coefficients)
        for name, wrap in (("numpy", np.array),
                           ("tensor", lambda v: torch.tensor(v, dtype=torch.float64))):
            with self.subTest(name):
                wired = self.build_wire(
                    name, eps=wrap(1e-7), extra_scale_factor=wrap(0.5),
                    ns_steps=np.int64(6) if name == "numpy" else 6,
                    custom_coefficients=wrap(coefficients))
                self.assertEqual(wired, plain)


class FixedEntriesTest(unittest.TestCase):
    """check_fixed's identity pass (groups.FixedEntries): an unchanged group
    passes without freezing its entries; a new object of an equal value still
    passes (entry by entry); any changed value, a list, a numpy array or a
    tuple subclass's state changed in place, a removed entry raise naming
    group and key."""

    def setUp(self):
        self.group = dict(algorithm="muon", lr=0.02, momentum=0.95, weight_decay=0.1,
                          nesterov=True, ns_steps=5, eps=1e-7, coefficient_type="simple",
                          custom_coefficients=[], betas=(0.9, 0.95), params=[])
        self.fixed = {0: muond_groups.fixed_entries(self.group)}

    def test_the_same_objects_are_unchanged_by_identity(self):
        self.assertTrue(self.fixed[0].unchanged_in(self.group))
        self.group["lr"] = 0.5  # live: not a fixed entry
        self.assertTrue(self.fixed[0].unchanged_in(self.group))
        muond_groups.check_fixed([self.group], self.fixed)

    def test_an_equal_value_of_another_object_passes(self):
        self.group["eps"] = float("1e-7")  # equal, not the same object
        self.group["betas"] = (0.9, 0.95)
        self.group["custom_coefficients"] = []
        muond_groups.check_fixed([self.group], self.fixed)

    def test_changes_are_refused_naming_the_key(self):
        for key, change in (("ns_steps", lambda g: g.__setitem__("ns_steps", 4)),
                            ("coefficient_type",
                             lambda g: g.__setitem__("coefficient_type", "quintic")),
                            ("custom_coefficients",
                             lambda g: g["custom_coefficients"].append(1.0)),
                            ("eps", lambda g: g.pop("eps"))):
            with self.subTest(key=key):
                group = dict(self.group, custom_coefficients=[])
                fixed = {0: muond_groups.fixed_entries(group)}
                change(group)
                self.assertFalse(fixed[0].unchanged_in(group))
                with self.assertRaisesRegex(ValueError, rf"'{key}' changed from"):
                    muond_groups.check_fixed([group], fixed)

    def test_a_tuple_subclass_with_state_is_compared_by_value(self):
        class Coefficients(tuple):  # iterates over a list it keeps
            def __new__(cls, values):
                self = super().__new__(cls, values)
                self.values = list(values)
                return self

            def __iter__(self):
                return iter(self.values)

        value = Coefficients((1.0, 2.0, 3.0))
        group = dict(self.group, custom_coefficients=value)
        fixed = {0: muond_groups.fixed_entries(group)}
        muond_groups.check_fixed([group], fixed)
        value.values[0] = 9.0
        with self.assertRaisesRegex(ValueError, "'custom_coefficients' changed from"):
            muond_groups.check_fixed([group], fixed)

    def test_a_numpy_array_is_compared_by_value(self):
        for key, value, change in (("gram_restarts", np.array([1, 2]),
                                    lambda v: v.__setitem__(0, 3)),
                                   ("gram_min_aspect_ratio", np.array(1.5),
                                    lambda v: v.fill(2.0))):
            with self.subTest(key=key):
                group = dict(self.group, **{key: value})
                fixed = {0: muond_groups.fixed_entries(group)}
                muond_groups.check_fixed([group], fixed)  # unchanged: no error
                change(value)  # in place: the registered entry is a copy
                with self.assertRaisesRegex(ValueError, rf"'{key}' changed from"):
                    muond_groups.check_fixed([group], fixed)


class CheckLiveTest(unittest.TestCase):
    """check_live's one-pass acceptance of the usual live entries (finite
    floats, a bool) refuses what the entry-by-entry check refuses, naming
    the same key, and accepts what it accepts."""

    def test_the_usual_pass_agrees_with_the_entry_by_entry_check(self):
        usual = dict(algorithm="muon", lr=0.02, weight_decay=0.1, momentum=0.95,
                     nesterov=True, name="g")
        odd = [float("nan"), float("inf"), -float("inf"), True, np.float64("nan"),
               np.float32(0.5), "0.1", None, 1, torch.tensor(0.1), torch.tensor(float("inf"))]
        cases = [(key, v) for key in ("lr", "weight_decay", "momentum") for v in odd]
        cases += [("nesterov", v) for v in (1, 0, 2, 0.0, np.bool_(True), None, "yes")]
        label = muond_groups.group_label(0, usual)
        for key, value in cases:
            group = dict(usual, **{key: value})
            with self.subTest(key=key, value=value):
                try:
                    muond_groups._check_live_entries(label, group)
                    expected = None
                except ValueError as e:
                    expected = str(e)
                if expected is None:
                    muond_groups.check_live(0, group)
                else:
                    with self.assertRaises(ValueError) as raised:
                        muond_groups.check_live(0, group)
                    self.assertEqual(str(raised.exception), expected)
                    self.assertIn(repr(key), expected)
        muond_groups.check_live(0, usual)  # the usual group passes


if __name__ == "__main__":
    unittest.main()
