"""bench/llama_train_bench.py on CPU: `muond launch --device cpu --nproc-per-node N
-- torchrun --nproc-per-node N llama_train_bench.py --model tiny` with the real
servers (host-mode daemons, gloo trainers): fsdp and tp at 2 ranks, fsdp+tp and
hsdp (--inner 2) at 4, optimizers muond and torch (muonium: skipped on CPU, with
its note). One launch per layout (~15-20 s each on 2 cores); ddp (plain params:
no shard to copy back, nothing the four do not cover) is left out for time.

The independent references:
- torch.optim.Muon, run by the bench itself in every process on the same init
  and batches. Both sides run Newton-Schulz in fp32 (--muond-ns-precision
  highest, --torch-ns-precision fp32: torch's one bf16 cast swapped for an fp32
  copy, as tests/client/python/contract/common.py does), so the final params
  must agree to fp32 rounding: every tensor's ||muond - torch|| / ||torch|| <=
  1e-3 after 4 steps (measured: 3e-6 fsdp, fsdp+tp, hsdp; 8e-5 tp), checked
  here from the JSON and by the bench itself (--max-param-diff 1e-3: it exits 1
  on a mismatch), while the reference moved every tensor (AdamW ones included:
  their lr is raised to 1e-2) by >= 1e-2 of its norm, so a param left alone or a
  wrong shard copied back on either side fails (copying torch's replica back
  with Shard in place of fsdp+tp's _StridedShard: 1.08). The default bf16 NS on
  both sides is within 1e-2 on Llama-sized matrices
  (tests/gpu/test_exactness_vs_torch.py) but not on this model's 64x64 ones
  (~4e-2, torch's own bf16 rounding), hence fp32 here.
- The global batch: the first loss the bench reports (the mean over ranks of
  each rank's loss on its slice) equals a single-process forward of the seed's
  model on the whole global batch, computed here, to 2e-5 (measured 5e-7), so a
  wrong data slice fails (every rank on slice 0: 3e-3 off at dp 2, 1e-2 at dp 4;
  muond and torch share the slicing, so their comparison cannot see it). With
  dp 1 (tp) there is one slice.
- The MISMATCH path: the tp run passes --max-param-diff 1e-6, below its measured
  8e-5, and must exit 1 with MISMATCH in the table, the JSON and the merged
  report, its outputs written (the other layouts pass 1e-3 and exit 0).

Also: the same hyperparameters, as each built optimizer holds them (NS eps
1e-7 on both sides: muond's examples default to 1e-15); the reported medians are
the medians of the per-step max over ranks of each rank's recorded times, and
each rank's step time is its fwd+bwd plus optimizer time. Which wall span is
forward+backward and which the optimizer step is not checked: only timing could
tell them apart, and this test asserts no times. The JSON's fields are sane
(same first loss for both optimizers; the plan's NS load covers every rank; the
daemons' reported state is exactly fp32 momentum for the block matrices plus two
fp32 AdamW moments for the rest, summed over ranks, under fsdp and twice that
under hsdp's two replicas; the param comparison names the worst tensor's own
movement), bench/llama_train_report.py merges the four JSONs into one table.
Without a launch: a TP size not dividing the kv heads, --model 1b on CPU, a
missing --muonium-path, muond outside `muond launch`, --max-param-diff without
its comparison and every non-positive size (--layers 0, --ns-steps 0, --seq 1,
...) are refused naming the option before any process group; the report of a
run whose first optimizer failed is written (.json and .md, the failure named,
2-D layouts named with their --inner), and the merger gives usage and a
one-line error instead of a traceback.
After the launches no process, socket directory or shm object of the job is
left.
"""
import contextlib
import glob
import importlib.util
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import unittest
import uuid
from unittest import mock


from tests.common.launched import bin_dir, launch_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.abspath(os.path.join(HERE, "..", ".."))
BENCH = os.path.join(RUNFILES, "bench", "llama_train_bench.py")
REPORT = os.path.join(RUNFILES, "bench", "llama_train_report.py")
TOLERANCE = 1e-3
STEPS, WARMUP = 3, 1


def env():
    return launch_env()


def job_processes(marker):
    """Pids (other than this one) whose command line contains marker."""
    found = []
    for path in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(path, "cmdline"), "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        pid = int(path.split("/")[2])
        if pid != os.getpid() and marker in cmd:
            found.append(pid)
    return found


# (parallel, world, dp size, tp size, --max-param-diff, exit code expected)
LAYOUTS = [("fsdp", 2, 2, 1, TOLERANCE, 0),
           ("tp", 2, 1, 2, 1e-6, 1),  # below its 8e-5: the MISMATCH path
           ("fsdp+tp", 4, 2, 2, TOLERANCE, 0),
           ("hsdp", 4, 4, 1, TOLERANCE, 0)]
LOSS_TOLERANCE = 2e-5


class LlamaTrainBenchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="llb-", dir="/tmp")
        self.job = f"llb{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)  # runs last
        self.addCleanup(self.assert_nothing_left)

    def assert_nothing_left(self):
        self.assertEqual(glob.glob(f"/tmp/muond-{self.job}-*"), [])  # socket dirs
        self.assertEqual(glob.glob(f"/dev/shm/muond-{self.job}-*"), [])
        self.assertEqual(job_processes(self.job), [])
        self.assertEqual(job_processes(self.tmp), [])  # trainers (their --out)

    def run_bench(self, parallel, world, max_diff, rc):
        out = os.path.join(self.tmp, "out")
        n = str(world)
        argv = [sys.executable, "-m", "muond.cli", "launch", "--bin-dir", bin_dir(),
                "--device", "cpu", "--nproc-per-node", n, "--job-id", self.job,
                "--log-dir", os.path.join(self.tmp, f"logs-{parallel}"), "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", n, BENCH, "--model", "tiny", "--parallel", parallel,
                "--inner", "2", "--optimizers", "muond,torch,muonium", "--steps", str(STEPS),
                "--warmup", str(WARMUP), "--muond-ns-precision", "highest",
                "--torch-ns-precision", "fp32", "--adamw-lr", "1e-2",
                "--max-param-diff", str(max_diff), "--out", out]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env())
        self.assertEqual(proc.returncode, rc, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertIn("| optimizer | tokens/s |", proc.stdout)  # rank 0's table
        self.assertEqual("**MISMATCH**" in proc.stdout, rc != 0, proc.stdout[-3000:])
        stem = f"{parallel}-i2-w{world}" if "+" in parallel or parallel == "hsdp" \
            else f"{parallel}-w{world}"
        with open(os.path.join(out, f"{stem}.json")) as f:
            report = json.load(f)
        with open(os.path.join(out, f"{stem}.md")) as f:
            self.assertEqual("**MISMATCH**" in f.read(), rc != 0)
        return report, out

    def check_report(self, r, parallel, world, dp, tp, max_diff, rc):
        self.assertEqual((r["layout"]["parallel"], r["layout"]["world"],
                          r["layout"]["dp_size"], r["layout"]["tp_size"]),
                         (parallel, world, dp, tp))
        self.assertEqual(r["tokens_per_step"], dp * 4 * 32)  # tiny: 4 x 32 per dp rank
        self.assertEqual(sorted(r["results"]), ["muond", "torch"])
        self.assertIn("CPU", r["skipped"]["muonium"])
        for name, res in r["results"].items():
            self.assertEqual(len(res["losses"]), STEPS + WARMUP, name)
            self.assertTrue(all(math.isfinite(v) for v in res["losses"]), name)
            self.assertGreater(res["tokens_per_s"], 0, name)
            self.assertAlmostEqual(res["tokens_per_s"],
                                   r["tokens_per_step"] / (res["step_ms"] / 1e3), delta=1e-6 *
                                   res["tokens_per_s"])
            self.assertGreater(res["opt_step_ms"], 0, name)
            self.assertTrue(0 < res["opt_share"] < 1, name)
            ranks = res["ranks"]
            self.assertEqual([x["rank"] for x in ranks], list(range(world)))
            # The reported medians are of the per-step max over ranks of the
            # times each rank recorded (not the min, not one rank's).
            for key in ("fwd_bwd_ms", "opt_step_ms", "step_ms"):
                for x in ranks:
                    self.assertEqual(len(x[key]), STEPS, (name, key))
                slowest = [max(x[key][i] for x in ranks) for i in range(STEPS)]
                self.assertAlmostEqual(res[key], statistics.median(slowest),
                                       delta=1e-9 * res[key], msg=(name, key))
            for x in ranks:
                for i in range(STEPS):
                    self.assertAlmostEqual(x["step_ms"][i],
                                           x["fwd_bwd_ms"][i] + x["opt_step_ms"][i],
                                           delta=1e-6, msg=(name, x["rank"], i))
        # Same init, same first batch: the first loss is the same number, and it
        # is the whole global batch's loss (the right slice on every rank).
        self.assertEqual(r["results"]["muond"]["loss_first"], r["results"]["torch"]["loss_first"])
        self.assertAlmostEqual(r["results"]["torch"]["loss_first"], self.global_first_loss(dp),
                               delta=LOSS_TOLERANCE)
        # The same hyperparameters, read back from the built optimizers.
        hyper = r["results"]["torch"]["hyperparameters"]
        self.assertEqual(r["results"]["muond"]["hyperparameters"], hyper)
        self.assertEqual(hyper["muon"], {"lr": 0.02, "momentum": 0.95, "nesterov": True,
                                         "weight_decay": 0.1, "ns_steps": 5, "eps": 1e-7})
        self.assertEqual(hyper["adamw"], {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                          "weight_decay": 0.0})
        plan = r["results"]["muond"]["plan"]
        self.assertNotIn("error", plan)
        self.assertEqual(len(plan["rank_load"]), world)
        self.assertTrue(all(v > 0 for v in plan["rank_load"]), plan)
        q = r["ratios"]
        self.assertAlmostEqual(q["opt_ms_torch_over_muond"], r["results"]["torch"]["opt_step_ms"]
                               / r["results"]["muond"]["opt_step_ms"])
        self.assertIsNone(q["tokens_per_s_muond_over_muonium"])
        # The daemons' state (GetStatus state_bytes), independently: fp32 momentum per
        # block-matrix element, fp32 exp_avg + exp_avg_sq per other element; fsdp
        # shards every param over the daemons, hsdp over each replica's, TP
        # replicates the norms.
        params = r["model"]["params"]
        expect = (4 * params["block_matrices"] + 8 * params["others"]) / 2**30
        state = sum(x["daemon"]["state_gib"] for x in r["results"]["muond"]["ranks"])
        if parallel in ("fsdp", "hsdp"):
            replicas = r["layout"]["mesh"].get("replicate", 1)
            self.assertAlmostEqual(state, replicas * expect, delta=1e-12)
        else:
            self.assertGreaterEqual(state, expect - 1e-12)
        self.assertEqual(r["results"]["muond"]["daemon_state_gib"], max(
            x["daemon"]["state_gib"] for x in r["results"]["muond"]["ranks"]))
        self.assertNotIn("daemon_state_gib", r["results"]["torch"])
        # muond's step split: the daemon's phases (its StepTimings) lie within
        # its total, and every rank's split is in the report's table.
        for x in r["results"]["muond"]["ranks"]:
            ph = x["muond_phases_ms_median"]
            self.assertEqual(list(ph), ["momentum", "ns", "update", "exchange", "daemon_total",
                                        "handler_beyond_engine", "grpc_and_wakeups", "client"])
            self.assertGreaterEqual(ph["handler_beyond_engine"], 0)
            self.assertEqual(x["daemon_ns_ms_median"], ph["ns"])
            self.assertGreater(ph["daemon_total"], 0)
            self.assertLessEqual(ph["ns"] + ph["momentum"] + ph["update"],
                                 ph["daemon_total"] * (1 + 1e-9))
        self.assertNotIn("muond_phases_ms_median", r["results"]["torch"]["ranks"][0])
        import_bench()  # puts bench/ on sys.path
        from llama.run_report import markdown
        self.assertIn("## muond: where the optimizer step goes", markdown(r))
        cmp = r["params_muond_vs_torch"]
        self.assertEqual(cmp["worst_ref_change"], cmp["per_tensor"][cmp["worst"]]["ref_change"])
        self.assertEqual(len(cmp["per_tensor"]), 3 + 9 * 2)  # emb, norm, head; 9 per block
        for name, t in cmp["per_tensor"].items():
            self.assertLessEqual(t["rel_diff"], TOLERANCE, name)
            self.assertGreaterEqual(t["ref_change"], 10 * TOLERANCE, name)  # it trained
        self.assertEqual((cmp["max_param_diff"], cmp["verdict"]),
                         (max_diff, "MISMATCH" if rc else "ok"))

    def global_first_loss(self, dp):
        """A single-process forward of the seed's model on step 0's whole global
        batch (dp x 4 sequences, drawn as the bench draws it with one rank)."""
        import torch
        import torch.nn.functional as F
        bench = import_bench()
        args = bench.parser().parse_args(["--model", "tiny", "--device", "cpu",
                                          "--batch", str(dp * 4), "--seq", "32"])
        cfg = bench.model_config(args)
        x, y = bench.batch_at(0, args, cfg, 1, 0)
        self.assertEqual(tuple(x.shape), (dp * 4, 32))
        with torch.no_grad():
            model = bench.initial_model(args, cfg, torch.device("cpu"))
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    def test_layouts_match_torch_muon(self):
        reports = {}
        for parallel, world, dp, tp, max_diff, rc in LAYOUTS:
            report, out = self.run_bench(parallel, world, max_diff, rc)
            with self.subTest(parallel=parallel):
                self.check_report(report, parallel, world, dp, tp, max_diff, rc)
            reports[parallel] = report
        proc = subprocess.run([sys.executable, REPORT, out], capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        rows = {line.split(" | ")[0][2:]: line for line in proc.stdout.splitlines()
                if line.startswith("| ") and " | " in line}
        for parallel, *_, rc in LAYOUTS:
            row = rows[parallel]
            ratio = f"{reports[parallel]['ratios']['tokens_per_s_muond_over_torch']:.3f}"
            self.assertIn(f" {ratio} ", row)
            self.assertEqual("**MISMATCH** (> 1e-06)" in row, rc != 0, row)


def import_bench():
    spec = importlib.util.spec_from_file_location("llama_train_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RefusalTest(unittest.TestCase):
    """What main() refuses before any process group, in this process: exit 2, the
    option named, no traceback."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="llr-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.bench = import_bench()

    def main(self, *argv, world=2):
        """(exit code, stderr) of main(argv) as rank 0 of `world`, outside `muond launch`."""
        e = env()
        e.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
        err = io.StringIO()
        with mock.patch.dict(os.environ, e, clear=True), contextlib.redirect_stderr(err):
            try:
                rc = self.bench.main(["--out", self.tmp, *argv])
            except SystemExit as exit_:  # argparse
                rc = exit_.code
        return rc, err.getvalue()

    def test_non_positive_sizes(self):
        for option, value in [("--layers", "0"), ("--heads", "0"), ("--kv-heads", "0"),
                              ("--batch", "0"), ("--seq", "0"), ("--seq", "1"),
                              ("--steps", "0"), ("--warmup", "-1"), ("--ns-steps", "0"),
                              ("--inner", "0"), ("--threads", "-1"), ("--wait-healthy", "0"),
                              ("--max-param-diff", "0"), ("--layers", "two")]:
            with self.subTest(option=option, value=value):
                rc, err = self.main("--model", "tiny", "--device", "cpu", "--optimizers",
                                    "torch", option, value)
                self.assertEqual(rc, 2, err)
                self.assertIn(f"argument {option}: ", err)
                self.assertNotIn("Traceback", err)
        rc, err = self.main("--model", "tiny", "--device", "cpu", "--optimizers", "torch",
                            "--seq", "1")
        self.assertIn("llama_train_bench.py: error: argument --seq: must be >= 2, got 1 (with 1 token attention's softmax "
                      "has one key, so q and k get no gradient", err)

    def test_layout_and_environment(self):
        rc, err = self.main("--model", "tiny", "--kv-heads", "1", "--parallel", "tp",
                            "--optimizers", "torch")
        self.assertEqual(rc, 2, err)
        self.assertIn("--parallel tp: the 1 kv heads of --model tiny (--kv-heads) are not "
                      "divisible by the TP size 2", err)
        # muond without its servers: refused naming `muond launch`.
        rc, err = self.main("--model", "tiny", "--parallel", "fsdp", "--optimizers",
                            "muond,torch")
        self.assertEqual(rc, 2, err)
        self.assertIn("run under `muond launch", err)
        # The defaults' trap: --model 1b (the default) on CPU.
        rc, err = self.main("--device", "cpu", "--optimizers", "torch")
        self.assertEqual(rc, 2, err)
        self.assertIn("--model 1b on CPU", err)
        self.assertIn("pass --model tiny", err)
        # A missing --muonium-path with muonium to run, on CPU too (where muonium is
        # skipped, so nothing else would notice).
        missing = os.path.join(self.tmp, "nope")
        rc, err = self.main("--model", "tiny", "--device", "cpu", "--optimizers",
                            "torch,muonium", "--muonium-path", missing)
        self.assertEqual(rc, 2, err)
        self.assertIn(f"--muonium-path {missing}: no such directory", err)
        # A check that could not run is refused, not skipped.
        for argv in (["--optimizers", "muond,muonium"], ["--no-compare-params"]):
            rc, err = self.main("--model", "tiny", "--device", "cpu", "--max-param-diff",
                                "1e-3", *argv)
            self.assertEqual(rc, 2, err)
            self.assertIn("--max-param-diff 0.001 checks muond's final params against "
                          "torch's: it needs muond and torch in --optimizers and "
                          "--compare-params", err)
        self.assertNotIn("Traceback", err)


class ReportWithoutLaunchTest(unittest.TestCase):
    """The outputs of a run whose first optimizer failed, and the merger's
    command line; no servers."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="llr-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.bench = import_bench()

    def failed_report(self, inner):
        """What main() holds when the first optimizer (muond) raised: no results."""
        b = self.bench
        args = b.parser().parse_args(["--model", "tiny", "--device", "cpu", "--parallel",
                                      "hsdp", "--inner", str(inner)])
        args.batch, args.seq = b.BATCH_DEFAULTS["tiny"]
        cfg = b.model_config(args)
        return {
            "command": "llama_train_bench.py --model tiny --parallel hsdp", "config": vars(args),
            "model": {**cfg.__dict__, "params": cfg.param_counts()},
            "layout": {"parallel": "hsdp", "world": 4, "device": "cpu", "backend": "gloo",
                       "mesh": {"replicate": 4 // inner, "shard": inner}, "dp_size": 4,
                       "tp_size": 1, "inner": inner},
            "tokens_per_step": 4 * args.batch * args.seq, "notes": b.optimizer_notes(args),
            "skipped": {"muond": "FAILED: RuntimeError: the daemon went away\n  at step 2"},
            "results": {}, "ratios": {}, "versions": {}}  # as main() starts it

    def test_first_optimizer_failed_is_written_and_merged(self):
        out = os.path.join(self.tmp, "out")
        for inner in (2, 4):
            text = self.bench.write_outputs(self.failed_report(inner), out)
            self.assertIn("**muond FAILED**", text)
            self.assertIn("RuntimeError: the daemon went away", text)
            self.assertIn("| muond | not run (below) |", text)
        self.assertEqual(sorted(os.listdir(out)), ["hsdp-i2-w4.json", "hsdp-i2-w4.md",
                                                    "hsdp-i4-w4.json", "hsdp-i4-w4.md"])
        proc = subprocess.run([sys.executable, REPORT, out], capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| hsdp ")]
        self.assertEqual(len(rows), 2, proc.stdout)  # one per --inner, not one overwriting
        self.assertIn("replicate 2 x shard 2", rows[0])
        self.assertIn("replicate 1 x shard 4", rows[1])
        self.assertIn("muond (hsdp, world 4): FAILED: RuntimeError: the daemon went away",
                      proc.stdout)
        self.assertIn("> 1 means muond is faster", proc.stdout)
        self.assertIn("not a speed comparison", proc.stdout)

    def test_report_command_line(self):
        proc = subprocess.run([sys.executable, REPORT, "--help"], capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("usage: llama_train_report.py", proc.stdout)
        missing = os.path.join(self.tmp, "nope")
        proc = subprocess.run([sys.executable, REPORT, missing], capture_output=True,
                              text=True, timeout=60)
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(proc.stderr.strip(),
                         f"llama_train_report.py: {missing}: no such file or directory")


if __name__ == "__main__":
    unittest.main()
