"""A daemon on TCP requires the job's token: the Python client sends it
(`Client(..., token=)`, `muond.torch.Muon(..., token=)`) and then trains as
torch.optim.Muon does (fp32 NS, fp32 rounding); a wrong or missing token is
refused UNAUTHENTICATED (a coordinator + 1 host daemon on 127.0.0.1)."""
import importlib
import os
import sys
import time
import unittest

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REL_TOL, ClusterTestCase, TorchReference, muon_group, muond_opt, rel_diff  # noqa: E402
from muond.client import Client, MuondError  # noqa: E402


class TcpTokenTest(ClusterTestCase):
    NUM_DAEMONS = 1
    TCP = True

    def test_client_token_is_sent_and_a_wrong_one_refused(self):
        address = self.cluster.daemons[0]
        with Client(address, timeout=10, token=self.cluster.token) as good:
            self.assertTrue(good.health().serving)
        for token in ("wrong", None):
            kw = {} if token is None else {"token": token}
            with Client(address, timeout=10, **kw) as bad:
                with self.assertRaises(grpc.RpcError) as caught:
                    bad.health()
                self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED,
                                 f"token {token!r}")

    def test_muon_over_tcp_with_token_matches_torch(self):
        initial = torch.randn(12, 8, generator=torch.Generator().manual_seed(5))
        out = {}
        for side in ("torch", "muond"):
            w = torch.nn.Parameter(initial.clone())
            groups = [muon_group([w], ["w"])]
            opt = (TorchReference(groups) if side == "torch" else
                   muond_opt(self.cluster, groups, token=self.cluster.token))
            try:
                for s in range(1, 4):
                    opt.zero_grad()
                    w.grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(s))
                    opt.step()
            finally:
                opt.close()
            out[side] = w.detach().clone()
        self.assertFalse(torch.equal(out["muond"], initial))
        self.assertLessEqual(rel_diff(out["muond"], out["torch"]), REL_TOL)

    def test_a_refused_token_fails_at_once_saying_what_to_pass(self):
        address = self.cluster.daemons[0]
        for token in ("wrong", None):
            kw = {} if token is None else {"token": token}
            with Client(address, timeout=10, **kw) as bad:
                t0 = time.monotonic()
                with self.assertRaises(MuondError) as caught:
                    bad.wait_healthy(30)
                self.assertLess(time.monotonic() - t0, 5, f"token {token!r}")
            self.assertEqual(caught.exception.code, grpc.StatusCode.UNAUTHENTICATED)
            self.assertIn(address, str(caught.exception))
            self.assertIn("token=", str(caught.exception))
        w = torch.nn.Parameter(torch.zeros(4, 4))
        # torch.optim imports torch._dynamo at a process's first optimizer
        # (seconds on a loaded machine): done before the clock starts, so the
        # bound measures the refusal only.
        importlib.import_module("torch._dynamo")
        t0 = time.monotonic()
        with self.assertRaisesRegex(MuondError, "token_file="):
            muond_opt(self.cluster, [muon_group([w], ["w"])], token="wrong",
                      wait_healthy_timeout=30)
        self.assertLess(time.monotonic() - t0, 5)

    def test_muon_with_a_wrong_token_is_refused(self):
        w = torch.nn.Parameter(torch.zeros(4, 4))
        with self.assertRaisesRegex(Exception, "UNAUTHENTICATED|token"):
            muond_opt(self.cluster, [muon_group([w], ["w"])], token="wrong",
                      wait_healthy_timeout=2).close()


if __name__ == "__main__":
    unittest.main()
