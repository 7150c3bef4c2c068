"""tools/gram_restart_tuner.py: the committed default restart table in
core/muon/coefficients.cc is the tuner's output, and the tuner (a port of
gram-newton-schulz 0.1.6's restart_autotune.py) reproduces the peer's own
answer for the peer's Polar Express set."""
import os
import pathlib
import sys
import unittest

import numpy as np


def _runfile(rel):
    for root in (os.environ.get("TEST_SRCDIR", ""), os.getcwd()):
        for p in (pathlib.Path(root) / os.environ.get("TEST_WORKSPACE", "") / rel,
                  pathlib.Path(root) / rel):
            if p.exists():
                return p
    raise FileNotFoundError(rel)


TUNER = _runfile("tools/gram_restart_tuner.py")
COEFFS = _runfile("core/muon/coefficients.cc")
sys.path.insert(0, str(TUNER.parent))
import gram_restart_tuner as tuner  # noqa: E402

# gram_newton_schulz/coefficients.py POLAR_EXPRESS_COEFFICIENTS (arXiv
# 2505.16932 with the peer's 1.05 safety factor); the peer's tuner answers
# [2] with cond(Q) 84.572 (autotune_restarts.py defaults), its default.
_PE = [(8.28721201814563, -23.595886519098837, 17.300387312530933),
       (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
       (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
       (3.3184196573706015, -2.488488024314874, 0.51004894012372),
       (2.300652019954817, -1.6689039845747493, 0.4188073119525673)]
PEER_PE = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in _PE]


class TunerTest(unittest.TestCase):
    def test_committed_table_is_the_tuners_output(self):
        # 10 = kGramRestartTableSteps (core/muon/coefficients.h).
        want = {k: v[0] for k, v in tuner.table(10, COEFFS).items()}
        got = tuner.committed_table(COEFFS)
        self.assertEqual(len(got), 60)
        self.assertEqual(got, want)

    def test_reproduces_the_peers_answer(self):
        sigma = np.logspace(0, -10, 10000)
        restarts, score = tuner.best_restarts(PEER_PE, sigma)
        self.assertEqual(restarts, [2])
        self.assertAlmostEqual(score, 84.572, places=2)

    def test_a_restart_lowers_the_score(self):
        sigma = np.logspace(0, -10, 10000)
        coefs = tuner.schedule("quintic", tuner.builtin_sets(COEFFS)["quintic"], 5)
        self.assertGreater(tuner.score(coefs, set(), sigma), 1e8)
        self.assertLess(tuner.score(coefs, {2}, sigma), 1e2)


if __name__ == "__main__":
    unittest.main()
