"""The Muon variants (NorMuon, AdaMuon) on the client side, without servers:
their options are per-group, fixed at registration, on the wire as the
daemon reads them and refused naming group and key before any RPC (fake
daemons, fake_daemon.py); their state keys and shapes in torch.optim's
format (muond.state) go to each daemon's shard and back for every layout
(whole, split rows / columns with pad rows, batched, split QKV's permuted
rows): a daemon's entry is exactly its shard's rows (NorMuon) or elements
(AdaMuon), computed here from the param independently of muond.state."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import FakeClusterTestCase  # noqa: E402 (puts client/python on sys.path)

from muond import batched, split  # noqa: E402
from muond import state as mstate  # noqa: E402
from muond.torch import Muon, ScalingOptions  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 6, generator=g)),
            torch.nn.Parameter(torch.randn(6, 4, generator=g))]


class VariantOptionsTest(FakeClusterTestCase):

    def wire(self):
        return {g.name: g.muon for g in self.cluster.daemons[0].requests[-1].groups}

    def test_flat_keywords_and_per_group_overrides_reach_the_wire(self):
        a, b = params()
        opt = self.build([{"params": [a], "name": "nor"},
                          {"params": [b], "name": "ada", "variant": "adamuon", "beta2": 0.5}],
                         variant="normuon", beta2=0.9, moment2_eps=1e-6)
        self.assertEqual([g["variant"] for g in opt.param_groups], ["normuon", "adamuon"])
        wire = self.wire()
        self.assertEqual(wire["nor"].variant, pb.MUON_VARIANT_NORMUON)
        self.assertEqual((wire["nor"].beta2, wire["nor"].moment2_eps), (0.9, 1e-6))
        self.assertEqual(wire["ada"].variant, pb.MUON_VARIANT_ADAMUON)
        self.assertEqual((wire["ada"].beta2, wire["ada"].moment2_eps), (0.5, 1e-6))

    def test_the_options_object_equals_the_flat_keywords_and_defaults_are_dions(self):
        opt = self.build([{"params": params(), "name": "g"}],
                         scaling=ScalingOptions(variant="adamuon"))
        group = opt.param_groups[0]
        self.assertEqual((group["variant"], group["beta2"], group["moment2_eps"]),
                         ("adamuon", 0.95, 1e-8))
        self.assertEqual(self.wire()["g"].variant, pb.MUON_VARIANT_ADAMUON)
        opt.close()
        self.build([{"params": params(), "name": "g"}])
        self.assertEqual(self.wire()["g"].variant, pb.MUON_VARIANT_MUON)

    def test_bad_values_are_refused_naming_group_and_key_before_any_rpc(self):
        cases = [({"variant": "NorMuon"}, "'variant' must be one of"),
                 ({"variant": None}, "'variant' must be one of"),
                 ({"beta2": 1.0}, r"'beta2' must be a real number in \[0, 1\)"),
                 ({"beta2": -0.1}, "'beta2'"), ({"beta2": "0.9"}, "'beta2'"),
                 ({"beta2": True}, "'beta2'"), ({"moment2_eps": 0.0}, "'moment2_eps'"),
                 ({"moment2_eps": float("inf")}, "'moment2_eps'"),
                 ({"moment2_eps": 1e-50}, r"'moment2_eps' must be a finite real number > 0 "
                                          r"\(as fp32\)")]
        for extra, message in cases:
            with self.subTest(extra=extra):
                with self.assertRaisesRegex(ValueError, "param group 0 \\('w'\\): " + message):
                    Muon([{"params": params(), "name": "w", **extra}],
                         daemons=self.addresses, job_id="fake")
        with self.assertRaisesRegex(ValueError, "param group 0 .*'beta2'"):
            Muon(params(), daemons=self.addresses, job_id="fake", variant="normuon", beta2=2)
        self.assertEqual(self.cluster.daemons[0].requests, [])

    def test_a_changed_variant_is_refused_at_step(self):
        opt = self.build([{"params": params(), "name": "g"}], variant="normuon")
        for key, value in (("variant", "adamuon"), ("beta2", 0.5)):
            with self.subTest(key=key):
                old = opt.param_groups[0][key]
                opt.param_groups[0][key] = value
                with self.assertRaisesRegex(ValueError, f"'{key}' changed from"):
                    opt.step()
                opt.param_groups[0][key] = old


def shard_rows(layout, s):
    """The param rows shard ``s`` holds, from muond.split's documented buffer layout."""
    start = s.offset // layout.full_shape[1]
    return list(range(start, start + s.shape[0]))


class VariantStateLayoutTest(unittest.TestCase):
    def round_trip(self, info, state, world):
        states = mstate.validate([info], {info.name: state})
        per_rank = mstate.disassemble([info], states, world)
        back = mstate.assemble([info], dict(enumerate(per_rank)))[info.name]
        for key, value in state.items():
            self.assertTrue(torch.equal(back[key], value), key)
        return per_rank

    def test_split_layouts_give_each_shard_its_rows(self):
        P, Q = 9, 8
        g = torch.Generator().manual_seed(1)
        v = torch.rand(P, 1, generator=g)
        m = torch.randn(P, Q, generator=g)
        for G, T, pref in ((2, 1, None), (2, 2, 1), (1, 3, 0), (3, 2, 1)):
            layout = split.plan_split((P, Q), G, T, pref)
            if layout is None:
                continue
            with self.subTest(G=G, T=T, tp_dim=layout.tp_dim):
                info = mstate.ParamInfo("w", "muon", (P, Q), layout, variant="normuon")
                per_rank = self.round_trip(info, {"momentum_buffer": m, "variance_neuron": v},
                                           G * T)
                padded = torch.cat([v.reshape(-1), torch.zeros(layout.buffer_rows - P)])
                for s in layout.shards:
                    self.assertTrue(torch.equal(per_rank[s.rank]["w.variance_neuron"],
                                                padded[shard_rows(layout, s)]))
                info = mstate.ParamInfo("w", "muon", (P, Q), layout, variant="adamuon")
                self.round_trip(info, {"momentum_buffer": m, "moment2_buffer": m.abs()}, G * T)

    def test_batched_and_permuted_rows_per_matrix(self):
        E, R, C = 3, 4, 5
        g = torch.Generator().manual_seed(2)
        mats = tuple(batched.Matrix(f"x[{e}]", e * R * C, (R, C), ("solo", e % 2))
                     for e in range(E))
        info = mstate.ParamInfo("x", "muon", (E, R, C), batched.BatchLayout(mats),
                                variant="normuon")
        v = torch.rand(E, R, 1, generator=g)
        per_rank = self.round_trip(info, {"momentum_buffer": torch.randn(E, R, C, generator=g),
                                          "variance_neuron": v}, 2)
        for e in range(E):
            self.assertTrue(torch.equal(per_rank[e % 2][f"x[{e}].variance_neuron"],
                                        v[e].reshape(-1)))
        # Split QKV: staging row i is the param's row perm[i]; q = rows 0..2, k = 3..5.
        perm = (1, 4, 0, 5, 2, 3)
        mats = (batched.Matrix("w[q]", 0, (3, C), "local"),
                batched.Matrix("w[k]", 3 * C, (3, C), "local"))
        info = mstate.ParamInfo("w", "muon", (6, C), batched.BatchLayout(mats, perm),
                                variant="normuon")
        v = torch.rand(6, 1, generator=g)
        per_rank = self.round_trip(info, {"momentum_buffer": torch.randn(6, C, generator=g),
                                          "variance_neuron": v}, 1)
        self.assertTrue(torch.equal(per_rank[0]["w[k].variance_neuron"],
                                    v[[perm[3], perm[4], perm[5]]].reshape(-1)))

    def test_wrong_shapes_negative_values_and_missing_keys_are_named(self):
        info = mstate.ParamInfo("w", "muon", (4, 3), ("solo", 0), variant="normuon")
        m = torch.zeros(4, 3)
        for state, message in [
                ({"momentum_buffer": m, "variance_neuron": torch.zeros(4)},
                 r"param w: state\['variance_neuron'\] has shape \(4,\), the param needs "
                 r"\(4, 1\)"),
                ({"momentum_buffer": m, "variance_neuron": -torch.ones(4, 1)},
                 r"param w: state\['variance_neuron'\] has negative values"),
                ({"variance_neuron": torch.zeros(4, 1)}, r"param w: .*normuon needs all of"),
                ({"momentum_buffer": m, "moment2_buffer": m},
                 "are not normuon's .*another Muon variant: drop those keys"),
                ({"momentum_buffer": m,
                  "variance_neuron": torch.full((4, 1), 1e300, dtype=torch.float64)},
                 r"param w: state\['variance_neuron'\] has values beyond fp32's range "
                 r"\(\|x\| up to 1e\+300\)"),
                ({"momentum_buffer": m,
                  "variance_neuron": torch.full((4, 1), float("nan"))},
                 r"param w: state\['variance_neuron'\] has non-finite values")]:
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    mstate.validate([info], {"w": state})
        info = mstate.ParamInfo("w", "muon", (4, 3), ("solo", 0), variant="adamuon")
        with self.assertRaisesRegex(ValueError, r"state\['moment2_buffer'\] has negative"):
            mstate.validate([info], {"w": {"momentum_buffer": m,
                                           "moment2_buffer": m - 1}})
        zero = mstate.validate([info], {})["w"]
        self.assertEqual(tuple(zero["moment2_buffer"].shape), (4, 3))
        # A Muon checkpoint (momentum only) moves to a variant: its second
        # moment starts from zero, the momentum is kept.
        moved = mstate.validate([info], {"w": {"momentum_buffer": m + 2}})["w"]
        self.assertTrue(torch.equal(moved["momentum_buffer"], m + 2))
        self.assertTrue(torch.equal(moved["moment2_buffer"], torch.zeros(4, 3)))

    def test_adamw_groups_refuse_variant_options_and_numpy_values_become_python(self):
        import numpy as np
        from muond.torch import groups
        with self.assertRaisesRegex(ValueError, r"param group 1: 'beta2' is an option of a Muon "
                                                r"group's variant .* 'betas' and 'eps'"):
            groups.check_adamw_keys(1, {"algorithm": "adamw", "beta2": 0.5})
        group = {"algorithm": "muon", "variant": np.str_("adamuon"),
                 "beta2": np.float64(0.9), "moment2_eps": np.float32(1e-6)}
        groups.check_options(0, {**group, "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95,
                                 "nesterov": True, "ns_algorithm": "standard",
                                 "gram_dtype": "fp16"})
        from muond.torch import variants
        variants.check("g", group)
        self.assertEqual([type(group[k]) for k in ("variant", "beta2", "moment2_eps")],
                         [str, float, float])


if __name__ == "__main__":
    unittest.main()
