"""muond.torch.Muon's state_dtype and state_location on the client side,
without servers (fake daemons, fake_daemon.py): the keywords, the option
object and per-group keys (AdamW groups too) land in param_groups and on the
wire as the daemon reads them ("auto" stays in param_groups and goes on the
wire resolved over the whole group: bf16 when all its params are bf16, else
fp32, the same on every daemon whatever each holds); a value the daemons do
not know is a ValueError naming the group, the key and the allowed values
before any RPC; a changed one is refused at step(); a state dict of another
state_dtype loads (the daemons' import converts)."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import FakeClusterTestCase  # noqa: E402 (puts client/python on sys.path)

from muond.torch import Muon, StateStorageOptions  # noqa: E402
from muond.torch import groups as muond_groups  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402

# "auto" of groups()' fp32 params is fp32.
DTYPES = {"auto": pb.STATE_DTYPE_FP32, "fp32": pb.STATE_DTYPE_FP32,
          "bf16": pb.STATE_DTYPE_BF16, "fp8_e4m3": pb.STATE_DTYPE_FP8_E4M3}
LOCATIONS = {"device": pb.STATE_LOCATION_DEVICE, "host": pb.STATE_LOCATION_HOST}


def groups(**muon_keys):
    g = torch.Generator().manual_seed(3)
    return [{"params": [torch.nn.Parameter(torch.randn(8, 6, generator=g))], "name": "w",
             **muon_keys},
            {"params": [torch.nn.Parameter(torch.randn(5, generator=g))], "name": "b",
             "algorithm": "adamw"}]


class StateStorageOptionsTest(FakeClusterTestCase):

    def wire(self):
        """Group name -> (state_dtype, state_location) of the last registration
        (an AdamW group's wire name is "<name>.solo-r<rank>")."""
        out = {}
        for g in self.cluster.daemons[0].requests[-1].groups:
            h = g.adamw if g.algorithm == pb.ALGORITHM_ADAMW else g.muon
            out[g.name.split(".")[0]] = (h.state_dtype, h.state_location)
        return out

    def test_defaults_are_auto_on_the_device(self):
        opt = self.build(groups())
        self.assertEqual([(g["state_dtype"], g["state_location"]) for g in opt.param_groups],
                         [("auto", "device")] * 2)
        want = (pb.STATE_DTYPE_FP32, pb.STATE_LOCATION_DEVICE)
        self.assertEqual(self.wire(), {"w": want, "b": want})

    def test_keywords_and_group_keys_reach_the_wire_for_both_algorithms(self):
        for dtype in DTYPES:
            for location in LOCATIONS:
                with self.subTest(dtype=dtype, location=location):
                    opt = self.build(groups(), state_dtype=dtype, state_location=location)
                    want = (DTYPES[dtype], LOCATIONS[location])
                    self.assertEqual(self.wire(), {"w": want, "b": want})
                    opt.close()
        params = groups(state_dtype="fp8_e4m3")
        params[1].update(state_dtype="bf16", state_location="host")
        opt = self.build(params, state_dtype="fp32")
        self.assertEqual(self.wire(), {
            "w": (pb.STATE_DTYPE_FP8_E4M3, pb.STATE_LOCATION_DEVICE),
            "b": (pb.STATE_DTYPE_BF16, pb.STATE_LOCATION_HOST)})
        self.assertEqual(opt.param_groups[1]["state_location"], "host")

    def test_the_option_object_equals_the_keywords(self):
        opt = self.build(groups(), state_storage=StateStorageOptions(
            state_dtype="bf16", state_location="host"))
        by_object = self.wire()
        opt.close()
        self.build(groups(), state_dtype="bf16", state_location="host")
        self.assertEqual(self.wire(), by_object)
        with self.assertRaisesRegex(ValueError, "give state_dtype= or state_storage="):
            Muon(groups(), daemons=self.addresses, job_id="fake", state_dtype="bf16",
                 state_storage=StateStorageOptions())

    def test_bad_values_are_refused_naming_group_key_and_allowed_values(self):
        dtypes = r"\['auto', 'fp32', 'bf16', 'fp8_e4m3'\]"
        cases = [({"state_dtype": "fp16"}, f"'state_dtype' must be one of {dtypes}, got 'fp16'"),
                 ({"state_dtype": "BF16"}, "'state_dtype' must be one of"),
                 ({"state_dtype": None}, "'state_dtype' must be one of"),
                 ({"state_dtype": torch.bfloat16}, "'state_dtype' must be one of"),
                 ({"state_location": "gpu"},
                  r"'state_location' must be one of \['device', 'host'\], got 'gpu'"),
                 ({"state_location": ""}, "'state_location' must be one of")]
        for extra, message in cases:
            with self.subTest(extra=extra):
                with self.assertRaisesRegex(ValueError, r"param group 0 \('w'\): " + message):
                    Muon(groups(**extra), daemons=self.addresses, job_id="fake")
                adamw = groups()
                adamw[1].update(extra)
                with self.assertRaisesRegex(ValueError, r"param group 1 \('b'\): " + message):
                    Muon(adamw, daemons=self.addresses, job_id="fake")
        with self.assertRaisesRegex(ValueError, "param group 0 .*'state_location'"):
            Muon(groups(), daemons=self.addresses, job_id="fake", state_location="cuda")
        self.assertEqual(self.cluster.daemons[0].requests, [])

    def test_a_changed_state_option_is_refused_at_step(self):
        opt = self.build(groups(), state_dtype="bf16")
        for key, value in (("state_dtype", "fp32"), ("state_location", "host")):
            with self.subTest(key=key):
                old = opt.param_groups[0][key]
                opt.param_groups[0][key] = value
                with self.assertRaisesRegex(ValueError, f"'{key}' changed from"):
                    opt.step()
                opt.param_groups[0][key] = old

    def test_a_state_dict_of_other_state_options_loads(self):
        opt = self.build(groups(), state_dtype="bf16", state_location="host")
        group = opt.param_groups[0]
        saved = dict(group, state_dtype="fp32", state_location="device")
        self.assertEqual(muond_groups.loaded_options(0, group, saved),
                         {k: group[k] for k in muond_groups.LIVE_KEYS["muon"]})


class AutoStateDtypeTest(FakeClusterTestCase):
    """"auto" over the whole group on two daemons that each hold one of its
    params: a daemon resolving it alone would keep bf16 state for a bf16
    param of a mixed group."""
    world = 2

    def wire_dtypes(self):
        """Daemon rank -> {wire group: (state_dtype, its params' names)}."""
        out = []
        for d in self.cluster.daemons:
            groups = d.requests[-1].groups
            out.append({g.name: ((g.adamw if g.algorithm == pb.ALGORITHM_ADAMW else
                                  g.muon).state_dtype, [p.name for p in g.params])
                        for g in groups})
        return out

    def test_auto_is_resolved_over_the_group_not_per_daemon(self):
        # The wire is what is checked: the fakes record the registration and
        # refuse it (they map fp32 memory only).
        for d in self.cluster.daemons:
            d.refuse_register = lambda request: "fake: recorded"
        bf16, fp32 = torch.bfloat16, torch.float32
        cases = [((bf16, fp32), pb.STATE_DTYPE_FP32), ((fp32, bf16), pb.STATE_DTYPE_FP32),
                 ((bf16, bf16), pb.STATE_DTYPE_BF16), ((fp32, fp32), pb.STATE_DTYPE_FP32)]
        for dtypes, want in cases:
            with self.subTest(dtypes=dtypes):
                params = [torch.nn.Parameter(torch.zeros(1000, dtype=d)) for d in dtypes]
                with self.assertRaisesRegex(RuntimeError, "fake: recorded"):
                    Muon([{"params": params, "name": "adam", "algorithm": "adamw",
                           "param_names": ["p0", "p1"]}], daemons=self.addresses,
                         job_id="fake", tp_size=2)
                self.assertEqual(self.wire_dtypes(), [{"adam.solo-r0": (want, ["p0"])},
                                                      {"adam.solo-r1": (want, ["p1"])}])


if __name__ == "__main__":
    unittest.main()
