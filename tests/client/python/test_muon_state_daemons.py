"""muond.torch.Muon's optimizer state through the real binaries: a coordinator
and two host daemons (Gloo, Unix sockets) in split mode, G x T = 1 x 2, with a
Muon group holding a split weight and a solo weight and an AdamW group.

* state_dict() -> torch.save -> torch.load -> load_state_dict() into a NEW
  optimizer (a new trainer on the same daemons) continues BITWISE equal to
  the uninterrupted run (ExportState / ImportState with a transaction, then
  LoadState COMMIT on both daemons).
* add_param_group mid-run (re-registration with the daemons) carries the old
  params' state: they continue bitwise equal to the run without the new group.
"""
import io
import os
import sys
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
from cluster import ClusterTestCase  # noqa: E402  (coordinator + host daemons)
from muond.split import SplitLayout  # noqa: E402
from muond.torch import Muon  # noqa: E402

G, T = 1, 2
MUON = {"split": (8, 6), "solo": (7, 5)}     # (7, 5) splits along neither dim over T = 2
ADAMW = {"bias": (8,), "norm": (5,)}
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
ADAMW_HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def values(seed, shape):
    return np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)


class PythonStateTest(ClusterTestCase):
    NUM_DAEMONS = G * T

    # -- a trainer ---------------------------------------------------------------
    def params(self, snapshot=None):
        out = {}
        for i, (name, shape) in enumerate((MUON | ADAMW).items()):
            value = snapshot[name] if snapshot else torch.from_numpy(values(100 + i, shape))
            out[name] = torch.nn.Parameter(value.clone())
        return out

    def optimizer(self, params):
        opt = Muon([{"params": [params[n] for n in MUON], "param_names": list(MUON),
                     "name": "dense"},
                    {"params": [params[n] for n in ADAMW], "param_names": list(ADAMW),
                     "name": "adam", "algorithm": "adamw", **ADAMW_HYPER}],
                   daemons=self.cluster.daemons, job_id=self.cluster.job_id, gtp_size=G, tp_size=T,
                   rpc_timeout=30, **HYPER)
        self.assertIsInstance(opt.layouts["split"], SplitLayout)
        self.assertEqual(opt.layouts["solo"][0], "solo")
        return opt

    @staticmethod
    def train(opt, params, steps):
        for step in steps:
            for i, (name, p) in enumerate(params.items()):
                p.grad = torch.from_numpy(values(1000 * step + i, tuple(p.shape)))
            opt.step()
        return {n: p.detach().clone() for n, p in params.items()}

    # -- the tests ---------------------------------------------------------------
    def test_resume_through_torch_save_into_a_new_optimizer_is_bitwise(self):
        params = self.params()
        opt = self.optimizer(params)
        try:
            self.train(opt, params, [1, 2])
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            snapshot = {n: p.detach().clone() for n, p in params.items()}
            want = self.train(opt, params, [3, 4])
        finally:
            opt.close()
        resumed = self.params(snapshot)
        opt = self.optimizer(resumed)
        try:
            buf.seek(0)
            sd = torch.load(buf, weights_only=True)
            self.assertEqual(sorted(sd["state"][0]), ["momentum_buffer"])
            self.assertEqual(tuple(sd["state"][0]["momentum_buffer"].shape), MUON["split"])
            self.assertEqual(float(sd["state"][2]["step"]), 2.0)
            opt.load_state_dict(sd)
            self.assertEqual(opt.step_id, 2)
            got = self.train(opt, resumed, [3, 4])
        finally:
            opt.close()
        for name in want:
            np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)
            self.assertFalse(torch.equal(got[name], snapshot[name]), name)

    def test_add_param_group_carries_the_state_of_the_old_params(self):
        params = self.params()
        opt = self.optimizer(params)
        try:
            want = self.train(opt, params, [1, 2, 3])
        finally:
            opt.close()
        params = self.params()
        opt = self.optimizer(params)
        try:
            self.train(opt, params, [1, 2])
            late = torch.nn.Parameter(torch.from_numpy(values(7, (6, 4))))
            before = late.detach().clone()
            opt.add_param_group({"params": [late], "param_names": ["late"], "name": "late"})
            self.assertEqual(opt.step_id, 2)
            got = self.train(opt, params | {"zz_late": late}, [3])
            self.assertEqual(opt.step_id, 3)
            self.assertFalse(torch.equal(late.detach(), before))
        finally:
            opt.close()
        for name in want:
            np.testing.assert_array_equal(got[name].numpy(), want[name].numpy(), err_msg=name)


if __name__ == "__main__":
    unittest.main()
