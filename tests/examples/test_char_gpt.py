"""examples/char_gpt/train.py at a tiny size: loss decreases, outputs exist, and
(--optimizer both, against in-process fake daemons) the muond run's params
equal the reference run's; train_dist.py's layout checks (the torchrun trainer
itself runs in tests/deploy/demo_test.py)."""
import json
import os
import subprocess
import sys
import shutil
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
TRAIN = os.path.join(REPO, "examples", "char_gpt", "train.py")
TINY = ["--steps", "6", "--layers", "1", "--d-model", "32", "--heads", "2", "--context", "16",
        "--batch", "8", "--eval-every", "3", "--eval-batches", "2", "--sample-chars", "20",
        "--warmup", "2", "--lr", "0.02", "--adamw-lr", "0.02", "--threads", "1"]


class CharGptTest(unittest.TestCase):
    def check_outputs(self, out, kinds):
        for f in ["report.md", "loss.png", "curves.json"] + [f"params_{k}.safetensors"
                                                             for k in kinds]:
            self.assertTrue(os.path.getsize(os.path.join(out, f)) > 0, f)
        with open(os.path.join(out, "curves.json")) as f:
            curves = json.load(f)
        self.assertEqual(sorted(curves["runs"]), sorted(kinds))
        for kind in kinds:
            r = curves["runs"][kind]
            losses = r["curves"]["train_loss"]
            self.assertEqual(len(losses), 6)
            self.assertLess(sum(losses[-2:]) / 2, losses[0], kind)  # loss decreases
            self.assertEqual(r["curves"]["val_step"], [3, 6])
            self.assertEqual(len(r["checksum"]["sha256"]), 64)
        self.assertGreater(curves["unigram_baseline"], 2.0)
        return curves

    def test_reference_run(self):
        out = tempfile.mkdtemp(prefix="char-gpt-")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        proc = subprocess.run([sys.executable, TRAIN, "--optimizer", "reference", "--out", out]
                              + TINY, capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("unigram baseline", proc.stdout)
        self.check_outputs(out, ["reference"])
        with open(os.path.join(out, "report.md")) as f:
            self.assertIn("Unigram baseline", f.read())

    def test_both_with_fake_daemons(self):
        sys.path.insert(0, os.path.join(REPO, "tests", "client", "python"))
        sys.path.insert(0, os.path.dirname(TRAIN))
        from fake_daemon import start_cluster
        import train
        out = tempfile.mkdtemp(prefix="char-gpt-")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        cluster, addresses = start_cluster(out, 4)
        try:
            rc = train.main(["--optimizer", "both", "--daemons", ",".join(addresses),
                             "--out", out] + TINY)
        finally:
            for d in cluster.daemons:
                d.stop()
        self.assertEqual(rc, 0)
        curves = self.check_outputs(out, ["reference", "muond"])
        runs = curves["runs"]
        self.assertEqual(curves["config"]["gtp"], 2)
        self.assertEqual(curves["config"]["tp"], 2)
        # Same formulas on the same matrices in the fake: bitwise equal.
        self.assertEqual(curves["max_rel_param_diff"], 0.0)
        self.assertEqual(runs["muond"]["checksum"], runs["reference"]["checksum"])
        self.assertEqual(runs["muond"]["curves"]["train_loss"],
                         runs["reference"]["curves"]["train_loss"])


class TrainDistLayoutTest(unittest.TestCase):
    """train_dist.check_layout: what a layout needs of the world size, --inner,
    --heads and the global --batch, refused before any collective."""

    def setUp(self):
        sys.path.insert(0, os.path.dirname(TRAIN))
        import train_dist
        self.td = train_dist

    def args(self, *argv):
        return self.td.parse_args(list(argv))

    def assertRefused(self, args, world, *phrases):
        with self.assertRaises(ValueError) as cm:
            self.td.check_layout(args, world)
        for phrase in phrases:
            self.assertIn(phrase, str(cm.exception))

    def test_sizes(self):
        cases = {"ddp": (4, 1), "fsdp": (4, 1), "tp": (1, 4), "fsdp+tp": (2, 2), "hsdp": (4, 1)}
        for layout, (dp, tp) in cases.items():
            a = self.args("--parallel", layout, "--heads", "4")
            self.td.check_layout(a, 4)
            self.assertEqual((self.td.dp_size(a, 4), self.td.tp_size(a, 4)), (dp, tp), layout)

    def test_refusals(self):
        self.assertRefused(self.args("--parallel", "fsdp+tp"), 3,
                           "--parallel fsdp+tp", "world size 3", "--inner 2")
        self.assertRefused(self.args("--parallel", "hsdp", "--inner", "4"), 6,
                           "world size 6", "--inner 4")
        self.assertRefused(self.args("--parallel", "tp", "--heads", "2"), 4,
                           "--heads 2", "TP size 4")
        self.assertRefused(self.args("--parallel", "ddp", "--batch", "6"), 4,
                           "--batch 6", "4 data-parallel ranks")
        self.td.check_layout(self.args("--parallel", "tp", "--batch", "6", "--heads", "4"), 4)


if __name__ == "__main__":
    unittest.main()
