"""fp16 params on a real host daemon: the Muon and AdamW paths step them in
place, and the result equals an independent reference — torch.optim.Muon /
AdamW in float64 on the same fp16 grads, each param rounded to fp16 after
every step as fp16 storage does — within fp16 rounding (2 ulps)."""
import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ClusterTestCase, TorchReference, adamw_group, muon_group,  # noqa: E402
                    muond_opt)

STEPS = 3
# fp16 keeps 11 significant bits: two units in the last place of x are at
# most 2 * 2^-10 * |x|.
FP16_TWO_ULPS = 2 * torch.finfo(torch.float16).eps
SHAPES = {"fc1": (16, 8), "fc2": (4, 16), "bias": (4,)}


def fp16_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).half())
            for n, s in SHAPES.items()}


def groups(params):
    return [muon_group([params["fc1"], params["fc2"]], ["fc1", "fc2"]),
            adamw_group([params["bias"]], ["bias"])]


def fp16_grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g).half() for n, s in SHAPES.items()}


class Fp16ParamsTest(ClusterTestCase):
    def test_fp16_steps_equal_a_float64_reference_within_fp16_rounding(self):
        params = fp16_params()
        opt = muond_opt(self.cluster, groups(params))
        ref_params = {n: torch.nn.Parameter(p.detach().double()) for n, p in params.items()}
        ref = TorchReference(groups(ref_params))
        start = {n: p.detach().double() for n, p in params.items()}
        try:
            for step in range(STEPS):
                for n, g in fp16_grads(step).items():
                    params[n].grad = g
                    ref_params[n].grad = g.double()
                opt.step()
                ref.step()
                with torch.no_grad():  # the reference's params stored in fp16
                    for p in ref_params.values():
                        p.copy_(p.half().double())
        finally:
            opt.close()
        for n, p in params.items():
            self.assertEqual(p.dtype, torch.float16, n)
            got, want = p.detach().double(), ref_params[n].detach()
            torch.testing.assert_close(got, want, rtol=FP16_TWO_ULPS, atol=1e-7, msg=n)
            # The steps moved every param well beyond the tolerance.
            moved = float((want - start[n]).abs().max())
            self.assertGreater(moved, 4 * FP16_TWO_ULPS * float(want.abs().max()), n)


if __name__ == "__main__":
    unittest.main()
