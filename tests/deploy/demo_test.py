"""The main job at a tiny size, as CI runs it: deploy/local/launch.py starts a
coordinator and 4 daemons (host mode), then a torchrun job of 4 gloo trainers
in the default layout (FSDP2 2 x TP 2) that finds its daemons from the
environment, trains a small char-GPT through them, and rank 0 trains the
in-process reference Muon (one process, the same global batches); then it
stops everything. One run of the default layout only (the layout suite is
tests/client/python/parallel/).

Checks: the launcher exits 0; loss decreases; muond's parameters after N steps
match the in-process reference within fp32 tolerance; the report names the
layout and every rank's NS load (the coordinator's plan: one entry per rank,
summing to the job's ns_cost computed here from the matrix shapes, none above
half of it;
each rank's daemon answered GetStatus with its own rank and timed NS); no
process, socket or shared-memory object of the job is left behind.

Why a tolerance and not bitwise: the daemons run Newton–Schulz with OpenBLAS
sgemm and the reference with torch's GEMMs, and the sharded forward/backward
(TP all-reduces, FSDP reduce-scatters) sums in other orders than one process.
Both are fp32, so each step differs by a few ulps and the differences
compound through training. After 8 steps they stay below 1e-3 relative (max
|a-b| / max|b| per tensor), while any real error in the optimizer or the
layout (a wrong shard, scale, momentum or data slice) shows up at 1e-1 or more.
"""
import glob
import json
import os
import subprocess
import sys
import shutil
import tempfile
import unittest
import uuid

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--context", "16",
        "--batch", "8", "--eval-every", "4", "--eval-batches", "2", "--sample-chars", "20",
        "--warmup", "2", "--lr", "0.02", "--adamw-lr", "0.02", "--threads", "1"]
STEPS = 8
TOLERANCE = 1e-3
NPROC = 4


def ns_cost(rows, cols):
    """core/plan/planner.h kNsCost: max * min^2 of the full matrix."""
    return max(rows, cols) * min(rows, cols) ** 2


def tiny_job_ns_cost():
    """The Muon matrices of TINY's model (1 layer, d_model 32): q, k, v, o
    (32 x 32), up (128 x 32), down (32 x 128)."""
    d = 32
    return 4 * ns_cost(d, d) + ns_cost(4 * d, d) + ns_cost(d, 4 * d)


def child_pids(pid):
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                             capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


class DemoTest(unittest.TestCase):
    def test_tiny_demo_end_to_end(self):
        out = tempfile.mkdtemp(prefix="muond-demo-test-")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        job = f"ci{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cmd = [sys.executable, os.path.join(RUNFILES, "deploy/local/launch.py"),
               "--steps", str(STEPS), "--nproc", str(NPROC), "--device", "cpu",
               "--bin", RUNFILES, "--out", out, "--job-id", job, "--", *TINY]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])

        # The launcher starts the coordinator with a per-launch token from a
        # file (never on a command line, where `ps` shows it to every user):
        # the coordinator says so, and no server's command line carries a token.
        with open(os.path.join(out, "logs", "coordinator.log")) as f:
            self.assertIn("(token required)", f.read())
        # The muonctl line it prints works as printed: subcommand first, the
        # job's real id and the token file (without them it cannot be run).
        self.assertRegex(proc.stdout, rf"muonctl status --coordinator 127\.0\.0\.1:\d+ "
                                      rf"--job_id {job} --token_file /tmp/muond-{job}-\S+/token")
        self.assertIn("--parallel fsdp+tp", proc.stdout)  # the default layout on CPU

        with open(os.path.join(out, "curves.json")) as f:
            curves = json.load(f)
        for kind in ("reference", "muond"):
            losses = curves["runs"][kind]["curves"]["train_loss"]
            self.assertEqual(len(losses), STEPS)
            self.assertLess(sum(losses[-2:]) / 2, losses[0], kind)
        diff = curves["max_rel_param_diff"]
        self.assertLessEqual(diff, TOLERANCE)
        self.assertGreater(curves["runs"]["muond"]["curves"]["train_loss"][0], 0)
        self.check_layout_and_ns_load(curves["layout"], out)

        # Clean stop: logs of every process, nothing of the job left running.
        logs = sorted(os.listdir(os.path.join(out, "logs")))
        self.assertIn("coordinator.log", logs)
        self.assertEqual(sum(name.startswith("muond-rank") for name in logs), NPROC)
        self.assertEqual(glob.glob(f"/dev/shm/muond-{job}*"), [])
        self.assertEqual(glob.glob(f"/tmp/muond-{job}-*"), [])  # socket dir
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        self.assertNotIn(f"--job_id={job}", ps)

    def check_layout_and_ns_load(self, layout, out):
        self.assertEqual(layout["parallel"], "fsdp+tp")
        self.assertEqual(layout["world"], NPROC)
        self.assertEqual(layout["mesh"], {"dp": 2, "tp": 2})
        self.assertEqual([r["rank"] for r in layout["ranks"]], list(range(NPROC)))
        for r in layout["ranks"]:
            self.assertEqual(r["daemon"].get("daemon_rank"), r["rank"], r)
            self.assertIn("ns_us", r["daemon_phases_ms_mean"], r)
        plan = layout["plan"]
        self.assertNotIn("error", plan)
        load = plan["rank_load"]
        self.assertEqual(len(load), NPROC)
        # Each matrix is orthogonalized once in the job (not once per rank),
        # and the work is spread: no rank carries more than the two largest
        # matrices (up and down, half the job) of TINY's model.
        total = tiny_job_ns_cost()
        self.assertAlmostEqual(sum(load), total, delta=1e-6 * total)
        self.assertLessEqual(max(load), total / 2, load)
        with open(os.path.join(out, "report.md")) as f:
            report = f.read()
        self.assertIn("layout: **fsdp+tp**, 4 trainer processes", report)
        self.assertIn("Newton–Schulz load per rank", report)
        for rank, value in enumerate(load):
            self.assertIn(f"| {rank} | ", report)
            self.assertIn(f"{value:.3g}", report)


if __name__ == "__main__":
    unittest.main()
