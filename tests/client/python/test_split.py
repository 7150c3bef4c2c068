"""muond.split against a plain numpy slicing reference (Megatron semantics:
TP split along tp_dim, pad the TP-local dim 0 with zero rows, GTP split dim 0)."""
import json
import os
import random
import unittest

import numpy as np

from muond import split


def reference_shard(full: np.ndarray, G: int, T: int, tp_dim, g: int, t: int) -> np.ndarray:
    local = np.split(full, T, axis=tp_dim)[t] if T > 1 else full
    pad = (-local.shape[0]) % G
    local = np.concatenate([local, np.zeros((pad, local.shape[1]), full.dtype)])
    return np.split(local, G, axis=0)[g]


def view(buffer: np.ndarray, s: split.Shard) -> np.ndarray:
    item = buffer.itemsize
    return np.lib.stride_tricks.as_strided(buffer[s.offset:], shape=s.shape,
                                           strides=[st * item for st in s.strides])


class SplitTest(unittest.TestCase):
    def check(self, P, Q, G, T, preferred):
        layout = split.plan_split((P, Q), G, T, preferred)
        if layout is None:
            # Not splittable only if no tp dim works (T > 1).
            self.assertGreater(T, 1)
            self.assertTrue(Q % T != 0 and (P % T != 0 or (P // T) % G != 0), (P, Q, G, T))
            return
        full = np.random.default_rng(P * 1000 + Q).standard_normal((P, Q)).astype(np.float32)
        buffer = np.zeros(layout.buffer_numel, np.float32)
        buffer[:P * Q] = full.ravel()  # the model's tensor is the contiguous prefix
        self.assertEqual(len(layout.shards), G * T)
        covered = np.zeros(layout.buffer_numel, np.int32)
        for s in layout.shards:
            self.assertEqual(s.rank, s.g * T + s.t)
            got = view(buffer, s)
            want = reference_shard(full, G, T, layout.tp_dim if T > 1 else None, s.g, s.t)
            np.testing.assert_array_equal(got, want, err_msg=f"{(P, Q, G, T, s)}")
            end = s.offset + (s.shape[0] - 1) * s.strides[0] + s.shape[1]
            self.assertLessEqual(end, layout.buffer_numel)
            view(covered, s)[...] += 1  # as_strided shares memory
        # Every buffer element belongs to exactly one daemon: no double update.
        self.assertTrue((covered == 1).all(), (P, Q, G, T))
        if T > 1 and preferred in (0, 1) and split._dim_works(P, Q, G, T, preferred):
            self.assertEqual(layout.tp_dim, preferred)
        if T > 1 and layout.tp_dim == 0:
            self.assertEqual(layout.pad_length, 0)

    def test_random_shapes(self):
        rnd = random.Random(7)
        for _ in range(400):
            G, T = rnd.choice([1, 2, 3, 4]), rnd.choice([1, 2, 3, 4])
            P, Q = rnd.randint(1, 40), rnd.randint(1, 40)
            self.check(P, Q, G, T, rnd.choice([None, 0, 1]))

    def test_padding_cases(self):
        self.check(9, 8, 2, 2, 1)    # tp_dim 1, one pad row
        self.check(10, 4, 4, 1, 0)   # T = 1, pad 2
        self.check(6, 8, 2, 2, 0)    # dim 0 would pad -> falls back to dim 1
        self.assertEqual(split.plan_split((6, 8), 2, 2, 0).tp_dim, 1)
        self.assertIsNone(split.plan_split((6, 7), 2, 2, 0))
        self.assertIsNone(split.plan_split((6,), 2, 2, 0))

    def test_ns_cost(self):
        self.assertEqual(split.ns_cost((8, 2)), 8 * 4)
        self.assertEqual(split.ns_cost((5,)), 5)



CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "core", "plan",
                     "sharding_cases.json")


class SameRulesAsCoreTest(unittest.TestCase):
    """The rules muond.split repeats from core/plan, on the table that
    tests/core/plan:sharding_cases_test checks the C++ against."""

    @classmethod
    def setUpClass(cls):
        with open(CASES) as f:
            cls.cases = json.load(f)

    def test_full_shape_from_local(self):
        self.assertTrue(self.cases["full_shape_from_local"])
        for c in self.cases["full_shape_from_local"]:
            got = split.full_shape_from_local(c["local_shape"], c["gtp_size"], c["tp_size"],
                                              **c["tags"])
            self.assertEqual(got, c["full_shape"], c["why"])

    def test_ns_cost(self):
        self.assertTrue(self.cases["ns_cost"])
        for c in self.cases["ns_cost"]:
            self.assertEqual(split.ns_cost(tuple(c["shape"])), c["cost"], c["shape"])


if __name__ == "__main__":
    unittest.main()
