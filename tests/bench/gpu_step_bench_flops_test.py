"""bench/gpu_step_bench.py's FLOP model against a count taken by running the
iterations: standard and Gram Newton-Schulz (the iteration of docs/ARCHITECTURE.md) in fp64
numpy with a matmul that adds 2 m n k per product, half when its result is symmetric (the
ceiling of a kernel that computes one triangle). Running them also checks the algebra the
model counts: Gram NS gives standard NS's result."""
import importlib.util
import os
import unittest

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "gpu_step_bench", os.path.join(ROOT, "bench", "gpu_step_bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SIMPLE = [(3.4445, -4.775, 2.0315)] * 5


class Counter:
    def __init__(self):
        self.flops = 0

    def mm(self, a, b):
        c = a @ b
        full = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        symmetric = c.shape[0] == c.shape[1] and np.allclose(c, c.T, rtol=1e-9, atol=1e-12)
        self.flops += full // 2 if symmetric else full
        return c


def standard(x, coefs, k):
    for a, b, c in coefs:
        g = k.mm(x, x.T)
        bm = b * g + c * k.mm(g, g)
        x = a * x + k.mm(bm, x)
    return x


def gram(x, coefs, restarts, k):
    eye = np.eye(x.shape[0])
    r, q = k.mm(x, x.T), None
    for i, (a, b, c) in enumerate(coefs):
        if i != 0 and i in restarts:
            x = k.mm(q, x)
            r, q = k.mm(x, x.T), None
        z = b * r + c * k.mm(r, r)
        q = z + a * eye if q is None else k.mm(q, z) + a * q
        if i < len(coefs) - 1 and i + 1 not in restarts:
            rz = k.mm(r, z) + a * r
            r = k.mm(z, rz) + a * rz
    return k.mm(q, x)


class FlopModelTest(unittest.TestCase):
    def x(self, s, big):
        x = np.random.default_rng(s * big).standard_normal((s, big))
        return x / np.linalg.norm(x)

    def test_standard_counts(self):
        for s, big in [(8, 8), (8, 24), (16, 40)]:
            k = Counter()
            standard(self.x(s, big), SIMPLE, k)
            self.assertEqual(bench.ideal_ns_flops((s, big), "standard"), k.flops)
            self.assertEqual(bench.ideal_ns_flops((big, s), "standard"), k.flops)
            self.assertEqual(bench.standard_ns_flops((s, big)),
                             5 * (4 * s * s * big + 2 * s ** 3))

    def test_gram_counts_and_equals_standard(self):
        for restarts in ([], [2], [3], [1, 3], [2, 4]):
            for s, big in [(8, 24), (16, 40)]:
                x = self.x(s, big)
                k = Counter()
                y = gram(x, SIMPLE, set(restarts), k)
                self.assertEqual(bench.ideal_ns_flops((s, big), "gram", restarts), k.flops,
                                 (restarts, s, big))
                np.testing.assert_allclose(y, standard(x, SIMPLE, Counter()), rtol=1e-9,
                                           atol=1e-10)

    def test_square_and_below_threshold_stay_standard(self):
        self.assertEqual(bench.ideal_ns_flops((64, 64), "gram", [2]),
                         bench.ideal_ns_flops((64, 64), "standard"))
        self.assertEqual(bench.ideal_ns_flops((64, 80), "gram", [2], min_aspect=1.5),
                         bench.ideal_ns_flops((64, 80), "standard"))
        self.assertLess(bench.ideal_ns_flops((64, 256), "gram", [2], min_aspect=1.5),
                        bench.ideal_ns_flops((64, 256), "standard"))

    def test_default_restarts_from_the_table(self):
        # DefaultGramRestarts (core/muon/coefficients.cc): simple x 5 restarts at 3 in
        # fp16 and fp32, at 2 and 3 in bf16; quintic x 5 at 2 in fp16, 2 and 3 in bf16;
        # polar_express bf16 at 2 and 3.
        for dtype in ("fp16", "fp32"):
            self.assertEqual(bench.default_gram_restarts(dtype), [3], dtype)
        self.assertEqual(bench.default_gram_restarts("bf16"), [2, 3])
        self.assertEqual(bench.default_gram_restarts("fp16", "kQuintic"), [2])
        self.assertEqual(bench.default_gram_restarts("bf16", "kQuintic"), [2, 3])
        self.assertEqual(bench.default_gram_restarts("bf16", "kPolarExpress"), [2, 3])
        self.assertIsNone(bench.default_gram_restarts("fp16", "kQuintic", steps=11))

    def test_size_aware_default_threshold_from_the_header(self):
        # DefaultGramMinAspectRatio (core/muon/gram_newton_schulz.h): 2.5 below a short
        # side of 1536, 1.5 from it (H200 sweep, bench/results/gpu_h200_step_vs_peer.md).
        self.assertEqual(bench.default_gram_min_aspect(1024), 2.5)
        self.assertEqual(bench.default_gram_min_aspect(1535), 2.5)
        self.assertEqual(bench.default_gram_min_aspect(1536), 1.5)
        self.assertEqual(bench.default_gram_min_aspect(4096), 1.5)
        # min_aspect None = that default for the shape's short side.
        self.assertEqual(bench.ideal_ns_flops((1024, 2048), "gram", [2], min_aspect=None),
                         bench.ideal_ns_flops((1024, 2048), "standard"))
        self.assertLess(bench.ideal_ns_flops((1024, 2560), "gram", [2], min_aspect=None),
                        bench.ideal_ns_flops((1024, 2560), "standard"))
        self.assertLess(bench.ideal_ns_flops((2048, 3072), "gram", [2], min_aspect=None),
                        bench.ideal_ns_flops((2048, 3072), "standard"))

    def test_one_restart_closed_form(self):
        s, big = 32, 96
        for restarts in ([2], [3]):
            self.assertEqual(bench.ideal_ns_flops((s, big), "gram", restarts),
                             6 * s * s * big + 14 * s ** 3)


if __name__ == "__main__":
    unittest.main()
