"""muond.torch.Muon with ns_algorithm="gram" through the real binaries (a
coordinator and one host daemon, CPU backend), against a numpy fp64 Gram
Newton-Schulz written here.

One step from zero params and zero momentum, weight_decay 0, nesterov off:
the update is -lr * sqrt(max(1, rows/cols)) * NS(0.05 * grad), so the params
after the step carry NS's output.

* fp32_matmul_prec="highest" (Gram iterates in fp32): wide and tall params
  match the fp64 Gram reference to 1e-5 (which equals standard NS's in fp64).
* "medium": Gram iterates in fp16 (the default gram_dtype), standard NS in
  bf16; Gram's error against the reference is below standard's and below
  Gram-in-bf16's, its bits are not standard's, and the square param (below
  the aspect-ratio threshold) runs standard NS in both optimizers, bitwise
  equal.
* Bad Gram options raise ValueError naming group and key before any RPC.
"""
import os
import sys
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
from cluster import ClusterTestCase  # noqa: E402  (coordinator + host daemons)
from muond.torch import Muon  # noqa: E402

SHAPES = {"wide": (8, 24), "tall": (30, 12), "square": (16, 16)}
LR, BETA = 0.02, 0.95
# muond's "quintic" set (core/muon/coefficients.cc), fp32-rounded.
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
QUINTIC = [tuple(float(np.float32(v)) for v in t) for t in QUINTIC]


def grad(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def gram_ns_reference(g, coefs, restarts, eps=1e-15):
    """Gram Newton-Schulz in fp64 (Zhang, Amsel, Chen, Dao 2026), transposing
    tall inputs explicitly."""
    x = np.asarray(g, dtype=np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(np.linalg.norm(x), eps)
    eye = np.eye(x.shape[0])
    r, q = x @ x.T, None
    for i, (a, b, c) in enumerate(coefs):
        if i in restarts and i != 0:
            x = q @ x
            r = x @ x.T
        z = b * r + c * r @ r
        q = z + a * eye if (i == 0 or i in restarts) else q @ z + a * q
        if i + 1 < len(coefs) and i + 1 not in restarts:
            rz = r @ z + a * r
            r = z @ rz + a * rz
    x = q @ x
    return x.T if tall else x


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class GramDaemonTest(ClusterTestCase):
    NUM_DAEMONS = 1

    def step_once(self, **options):
        """The NS outputs of one step for SHAPES (params start at zero)."""
        params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
        opt = Muon([{"params": list(params.values()), "param_names": list(params),
                     "name": "dense"}],
                   daemons=self.cluster.daemons, job_id=self.cluster.job_id, lr=LR,
                   momentum=BETA, nesterov=False, weight_decay=0.0,
                   coefficient_type="quintic", rpc_timeout=30, **options)
        try:
            for i, (name, p) in enumerate(params.items()):
                p.grad = torch.from_numpy(grad(10 + i, SHAPES[name]))
            opt.step()
        finally:
            opt.close()
        out = {}
        for name, p in params.items():
            rows, cols = SHAPES[name]
            out[name] = -p.detach().double().numpy() / (LR * max(1.0, rows / cols) ** 0.5)
        return out

    def want(self, name, restarts):
        ns_input = (np.float32(1 - BETA) * grad(10 + list(SHAPES).index(name), SHAPES[name]))
        return gram_ns_reference(ns_input, QUINTIC, restarts)

    def test_highest_matches_the_fp64_gram_reference(self):
        for restarts in (None, [1, 3]):
            got = self.step_once(fp32_matmul_prec="highest", ns_algorithm="gram",
                                 gram_restarts=restarts)
            for name in SHAPES:
                # The default restarts for quintic x 5 are [2] (the tuner's table).
                want = self.want(name, restarts if restarts is not None else [2])
                self.assertLess(rel(got[name], want), 1e-5, (name, restarts))

    def test_medium_fp16_gram_beats_bf16_standard_and_square_stays_standard(self):
        gram = self.step_once(fp32_matmul_prec="medium", ns_algorithm="gram")
        std = self.step_once(fp32_matmul_prec="medium", ns_algorithm="standard")
        gram_bf16 = self.step_once(fp32_matmul_prec="medium", ns_algorithm="gram",
                                   gram_dtype="bf16", gram_min_aspect_ratio=2.0)
        for name in ("wide", "tall"):
            want = self.want(name, [2])
            e_gram, e_std = rel(gram[name], want), rel(std[name], want)
            e_bf16 = rel(gram_bf16[name], want)
            print(f"{name}: gram fp16 {e_gram:.3g}, gram bf16 {e_bf16:.3g}, standard {e_std:.3g}")
            # The NS input and output are bf16 under "medium" (their rounding,
            # ~2e-3, is in every error); fp16 iteration keeps Gram below the
            # bf16 iterations of standard NS and of Gram in bf16.
            self.assertLess(e_gram, 5e-3, name)
            self.assertLess(e_gram, 0.8 * e_std, name)
            self.assertLess(e_gram, 0.8 * e_bf16, name)
            self.assertLess(e_bf16, 4e-2, name)
            # Gram ran: not standard's bits.
            self.assertFalse(np.array_equal(gram[name], std[name]), name)
            self.assertFalse(np.array_equal(gram_bf16[name], std[name]), name)
        # 16 x 16 is below every threshold: standard NS either way.
        np.testing.assert_array_equal(gram["square"], std["square"])

    def test_bad_gram_options_raise_before_any_rpc(self):
        p = torch.nn.Parameter(torch.zeros(4, 8))
        cases = [
            (dict(ns_algorithm="grams"), "'ns_algorithm' must be one of"),
            (dict(gram_dtype="fp32"), "'gram_dtype' must be one of"),
            (dict(gram_restarts=[0]), "'gram_restarts' entries must be ints in [1, ns_steps=5)"),
            (dict(gram_restarts=[5]), "'gram_restarts' entries"),
            (dict(gram_restarts=[3, 2]), "ascending and distinct"),
            (dict(gram_restarts="2"), "must be None or a list of ints"),
            # Not iterable: the check's ValueError, not list()'s TypeError.
            (dict(gram_restarts=2), "must be None or a list of ints"),
            (dict(gram_min_aspect_ratio=0.5), "'gram_min_aspect_ratio' must be None, 0"),
            (dict(gram_min_aspect_ratio=float("inf")), "'gram_min_aspect_ratio'"),
        ]
        for options, message in cases:
            with self.assertRaises(ValueError) as ctx:
                # A daemon address nothing listens on: the check comes first.
                Muon([{"params": [p], "name": "g"}], daemons=["unix:/nonexistent/muond.sock"],
                     wait_healthy_timeout=0.1, **options)
            self.assertIn("param group 0 ('g')", str(ctx.exception), options)
            self.assertIn(message, str(ctx.exception), options)


    def test_custom_coefficients_that_overflow_are_refused_and_nothing_changes(self):
        """Coefficients fp16 Gram NS cannot hold, against a real daemon: a coefficient
        above fp16's 65504 with fp16 Gram is refused naming the tuple; a
        schedule that overflows fp16 in the iteration (300^3) is refused at
        the step, params and momentum unchanged, and the next step runs."""
        p = torch.nn.Parameter(torch.from_numpy(grad(3, (8, 24))))
        with self.assertRaises(Exception) as ctx:
            opt = Muon([{"params": [p], "name": "g"}], daemons=self.cluster.daemons,
                       job_id=self.cluster.job_id, lr=LR, rpc_timeout=30,
                       ns_algorithm="gram", fp32_matmul_prec="medium",
                       ns_coefficients=[(70000.0, 0.0, 0.0)], ns_steps=1)
            try:
                p.grad = torch.ones_like(p)
                opt.step()
            finally:
                opt.close()
        self.assertIn("custom coefficients: tuple 0", str(ctx.exception))
        self.assertIn("fp16 range", str(ctx.exception))

        opt = Muon([{"params": [p], "name": "g"}], daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, lr=LR, momentum=BETA, rpc_timeout=30,
                   ns_algorithm="gram", fp32_matmul_prec="medium",
                   ns_coefficients=[(300.0, 0.0, 0.0)], ns_steps=3, gram_restarts=[])
        try:
            before = p.detach().clone()
            p.grad = torch.from_numpy(grad(4, (8, 24)))
            with self.assertRaises(Exception) as ctx:
                opt.step()
            self.assertIn("Newton-Schulz output is not finite", str(ctx.exception))
            self.assertIn("custom coefficients", str(ctx.exception))
            self.assertTrue(torch.equal(p.detach(), before))
            momentum = [v for st in opt.state_dict()["state"].values()
                        for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1]
            self.assertTrue(all(not m.any() for m in momentum), momentum)
            # The next step runs (the param skipped: grad None).
            p.grad = None
            opt.step()
            self.assertTrue(torch.equal(p.detach(), before))
        finally:
            opt.close()

    def test_client_gram_option_edges(self):
        """Hostile finding 4: integer-likes (numpy ints) are ints; None and 0
        are the same aspect ratio on load; messages show values as given."""
        from muond.torch.groups import check_gram_options, frozen, loaded_options, thawed
        group = {"name": "g", "algorithm": "muon", "ns_algorithm": "gram",
                 "gram_dtype": "fp16", "ns_steps": 5}
        check_gram_options(0, dict(group, gram_restarts=np.array([1, 3])))
        check_gram_options(0, dict(group, gram_restarts=[np.int64(2)]))
        with self.assertRaises(ValueError) as ctx:
            check_gram_options(0, dict(group, gram_restarts=[np.int64(3), np.int64(2)]))
        self.assertIn("ascending and distinct", str(ctx.exception))
        with self.assertRaises(ValueError):
            check_gram_options(0, dict(group, gram_restarts=[np.float32(2.0)]))
        with self.assertRaises(ValueError):
            check_gram_options(0, dict(group, gram_restarts=[True]))
        here = dict(group, gram_min_aspect_ratio=None, lr=0.02)
        self.assertEqual(loaded_options(0, here, {"gram_min_aspect_ratio": 0}), {})
        self.assertEqual(loaded_options(0, dict(here, gram_min_aspect_ratio=0.0),
                                         {"gram_min_aspect_ratio": None}), {})
        with self.assertRaises(ValueError) as ctx:
            loaded_options(0, here, {"gram_min_aspect_ratio": 2.0})
        self.assertIn("'gram_min_aspect_ratio'", str(ctx.exception))
        self.assertEqual(thawed(frozen([1, 3])), [1, 3])
        self.assertEqual(thawed(frozen(None)), None)


if __name__ == "__main__":
    unittest.main()
