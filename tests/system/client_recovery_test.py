"""muond.torch.Muon against real daemons (coordinator + 4 host daemons, 2x2):
what a trainer can recover from without restarting the daemons.

* A refused step (non-finite gradients: every daemon refuses it before
  anything changes) does not advance the client's step id, so the next step
  with finite gradients is accepted and equals the step a clean run takes.
* A constructor that fails after registering (here: waiting for the plan
  fails) unregisters everywhere, so the next trainer can register.
"""
import math
import os
import sys
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import split_trainer_test as base  # noqa: E402  (its cluster set-up)
from muond import client as client_module  # noqa: E402
from muond.torch import Muon  # noqa: E402


def make_params():
    w = torch.nn.Parameter(torch.from_numpy(base.values(7, (16, 12))))
    w.tensor_model_parallel, w.partition_dim = True, 0
    v = torch.nn.Parameter(torch.from_numpy(base.values(8, (12, 16))))
    v.tensor_model_parallel, v.partition_dim = True, 1
    return [w, v]


class ClientRecoveryTest(base.SplitTrainerSystemTest):
    def make_opt(self, params, **kw):
        return Muon([{"params": params, "name": "dense", "param_names": ["w", "v"]}],
                    lr=base.LR, weight_decay=base.WD, momentum=base.MOMENTUM,
                    daemons=self.daemons, job_id=self.job, gtp_size=base.G,
                    tp_size=base.T, rpc_timeout=30, fp32_matmul_prec="highest", **kw)

    def test_split_trainer_bitwise_across_rebalances(self):
        self.skipTest("run by split_trainer_test")

    def step_with(self, opt, params, seed):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(base.values(seed + i, tuple(p.shape)))  # copied at step
        opt.step()

    def test_refused_nonfinite_step_can_be_followed_by_a_good_one(self):
        clean, faulty = make_params(), make_params()
        opt = self.make_opt(faulty)
        try:
            self.step_with(opt, faulty, 100)
            before = [p.detach().clone() for p in faulty]
            faulty[0].grad[0, 0] = math.nan
            with self.assertRaisesRegex(RuntimeError, "non-finite"):
                opt.step()
            for p, b in zip(faulty, before):  # nothing was applied
                self.assertTrue(torch.equal(p.detach(), b))
            self.step_with(opt, faulty, 200)  # accepted: same step id retried
            self.assertEqual(opt.step_id, 2)
        finally:
            opt.close()
        # The same two good steps from a fresh trainer on the same daemons.
        opt = self.make_opt(clean)
        try:
            self.step_with(opt, clean, 100)
            self.step_with(opt, clean, 200)
        finally:
            opt.close()
        for a, b in zip(clean, faulty):
            np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())

    def test_failed_constructor_leaves_nothing_registered(self):
        real = client_module.Client.wait_healthy

        def no_plan(self, timeout=30.0, poll=0.1, need_plan=False):
            if need_plan:
                raise TimeoutError("simulated: no plan in time")
            return real(self, timeout, poll)

        client_module.Client.wait_healthy = no_plan
        try:
            with self.assertRaises(TimeoutError):
                self.make_opt(make_params())
        finally:
            client_module.Client.wait_healthy = real
        params = make_params()
        opt = self.make_opt(params)  # would be "params are already registered"
        try:
            self.step_with(opt, params, 300)
        finally:
            opt.close()


if __name__ == "__main__":
    unittest.main()
