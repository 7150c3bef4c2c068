"""A Step that reaches only some daemons heals without re-registration.

Coordinator + 4 host daemons (a 2 x 2 GTP_remat x TP domain, the real
binaries, --comm_timeout_s=3) and one split-mode muond.torch.Muon trainer.
Step 2 is sent as a raw Step RPC to daemons 0-2 only: each of them ends it
with UNAVAILABLE / PEER_GONE (nothing applied) once the job vote times out,
and the daemons rebuild their communicators under a new communicator epoch,
keeping their optimizer state. The trainer then sends step 2 to every daemon
and steps on: the params equal, bitwise, those of a run on the same daemons
in which the partial step never happened.
"""
import os
import sys
import time
import unittest

import grpc
import numpy as np
import torch

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python", "contract"))
from cluster import Cluster, find_binaries  # noqa: E402
from muond.client import PEER_GONE, error_info  # noqa: E402
from muond.torch import Muon  # noqa: E402

G, T = 2, 2
COMM_TIMEOUT_S = 3
STEPS = 4  # the partial step is step 2


def values(seed, shape):
    return np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)


def make_params():
    w = torch.nn.Parameter(torch.from_numpy(values(7, (16, 12))))
    w.tensor_model_parallel, w.partition_dim = True, 0
    v = torch.nn.Parameter(torch.from_numpy(values(8, (12, 16))))
    v.tensor_model_parallel, v.partition_dim = True, 1
    return [w, v]


class PartialStepHealTest(unittest.TestCase):
    def setUp(self):
        find_binaries(self)
        self.cluster = Cluster(G * T, token=False, comm_timeout_s=COMM_TIMEOUT_S).start()
        self.addCleanup(lambda: self.cluster.stop(print_logs=self._failed()))

    def _failed(self):
        result = getattr(self._outcome, "result", None)
        errors = getattr(result, "errors", []) + getattr(result, "failures", [])
        return any(test is self for test, _ in errors)

    def make_opt(self, params):
        return Muon([{"params": params, "name": "dense", "param_names": ["w", "v"]}],
                    lr=0.02, weight_decay=0.01, momentum=0.95, daemons=self.cluster.daemons,
                    job_id=self.cluster.job_id, gtp_size=G, tp_size=T, rpc_timeout=60,
                    fp32_matmul_prec="highest")

    @staticmethod
    def set_grads(params, step):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(values(100 * step + i, tuple(p.shape)))

    def partial_step(self, opt):
        """Step opt.step_id + 1 as raw RPCs to every daemon but the last: the
        error each of them answers."""
        step_id = opt.step_id + 1
        futures = [c.step_future(opt.job_id, step_id, opt._overrides(r), opt.client_id, [])
                   for r, c in enumerate(opt.clients[:-1])]
        errors = []
        for f in futures:
            with self.assertRaises(grpc.RpcError) as caught:
                f.result()
            errors.append(caught.exception)
        return errors

    def test_partial_step_then_every_daemon_steps_on_bitwise(self):
        faulty = make_params()
        opt = self.make_opt(faulty)
        try:
            for step in range(1, STEPS + 1):
                self.set_grads(faulty, step)
                if step == 2:
                    before = [p.detach().clone() for p in faulty]
                    start = time.monotonic()
                    errors = self.partial_step(opt)
                    # Liveness only: a comm timeout and the rebuild's report,
                    # far below a hung vote.
                    self.assertLess(time.monotonic() - start, 30)
                    for e in errors:
                        self.assertEqual(e.code(), grpc.StatusCode.UNAVAILABLE, e.details())
                        self.assertEqual(error_info(e).reason, PEER_GONE)
                        self.assertIn("send the step again", e.details())
                    for p, b in zip(faulty, before):  # nothing applied
                        self.assertTrue(torch.equal(p.detach(), b))
                    self.assertEqual({s.last_step_id for s in opt.status()}, {1})
                opt.step()  # step 2: resent to every daemon, no re-registration
            self.assertEqual(opt.step_id, STEPS)
        finally:
            opt.close()
        clean = make_params()
        opt = self.make_opt(clean)
        try:
            for step in range(1, STEPS + 1):
                self.set_grads(clean, step)
                opt.step()
        finally:
            opt.close()
        for a, b, initial in zip(clean, faulty, make_params()):
            self.assertFalse(torch.equal(a.detach(), initial.detach()))  # it stepped
            np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())


if __name__ == "__main__":
    unittest.main()
