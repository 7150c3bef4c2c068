"""bench/llama_train_bench.py on CPU: `muond launch --device cpu --nproc-per-node 2
-- torchrun --nproc-per-node 2 llama_train_bench.py --model tiny` with the real
servers (host-mode daemons, gloo trainers), layouts fsdp and tp, optimizers
muond and torch (muonium: skipped on CPU, with its note).

The independent reference is torch.optim.Muon, run by the bench itself in
every process on the same init and batches. Both sides run Newton-Schulz in
fp32 here (--muond-ns-precision highest, --torch-ns-precision fp32: torch's one
bf16 cast swapped for an fp32 copy, as tests/client/python/contract/common.py
does), so the final params must agree to fp32 rounding: every tensor's
||muond - torch|| / ||torch|| <= 1e-3 after 4 steps (measured: 3e-6 fsdp,
8e-5 tp), while the reference moved every tensor (AdamW ones included: their
lr is raised to 1e-2) by >= 1e-2 of its norm, so a param left alone, a wrong
shard copied back or a wrong data slice fails. The default bf16 NS on both sides
is within 1e-2 on Llama-sized matrices (tests/gpu/test_exactness_vs_torch.py)
but not on this model's 64x64 ones (~4e-2, torch's own bf16 rounding), hence
fp32 here.

Also: the JSON's fields are sane (same first loss for both optimizers: same
init and batch; the plan's NS load covers both ranks; the daemons' reported
state under fsdp is exactly fp32 momentum for the block matrices plus two fp32
AdamW moments for the rest, summed over ranks; the param comparison names the
worst tensor's own movement), bench/llama_train_report.py merges the two JSONs
into one table, and a TP size not dividing the kv heads, --model 1b on CPU and a
missing --muonium-path are refused naming the options before any process group.
Without a launch: the report of a run whose first optimizer failed is written
(.json and .md, the failure named, 2-D layouts named with their --inner), and
the merger gives usage and a one-line error instead of a traceback.
After each launch no process, socket directory or shm object of the job is left.
"""
import glob
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import uuid

import muond

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.abspath(os.path.join(HERE, "..", ".."))
BENCH = os.path.join(RUNFILES, "bench", "llama_train_bench.py")
REPORT = os.path.join(RUNFILES, "bench", "llama_train_report.py")
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
TOLERANCE = 1e-3
STEPS, WARMUP = 3, 1


def bin_dir():
    """The servers: Bazel's runfiles tree, else $MUOND_BIN_DIR."""
    if os.path.exists(os.path.join(RUNFILES, "server/daemon/muond-daemon")):
        return RUNFILES
    return os.environ["MUOND_BIN_DIR"]


def env():
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PKG_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
                "MUOND_DAEMON", "SLURM_PROCID", "SLURM_JOB_ID", "SLURM_NNODES"):
        e.pop(key, None)
    return e


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

    def run_bench(self, parallel):
        out = os.path.join(self.tmp, "out")
        argv = [sys.executable, "-m", "muond.cli", "launch", "--bin-dir", bin_dir(),
                "--device", "cpu", "--nproc-per-node", "2", "--job-id", self.job,
                "--log-dir", os.path.join(self.tmp, f"logs-{parallel}"), "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", BENCH, "--model", "tiny", "--parallel", parallel,
                "--optimizers", "muond,torch,muonium", "--steps", str(STEPS), "--warmup",
                str(WARMUP), "--muond-ns-precision", "highest", "--torch-ns-precision", "fp32",
                "--adamw-lr", "1e-2", "--out", out]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env())
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertIn("| optimizer | tokens/s |", proc.stdout)  # rank 0's table
        with open(os.path.join(out, f"{parallel}-w2.json")) as f:
            report = json.load(f)
        self.assertTrue(os.path.exists(os.path.join(out, f"{parallel}-w2.md")))
        return report, out

    def check_report(self, r, parallel, dp, tp):
        self.assertEqual((r["layout"]["parallel"], r["layout"]["world"],
                          r["layout"]["dp_size"], r["layout"]["tp_size"]), (parallel, 2, dp, tp))
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
            self.assertEqual([x["rank"] for x in res["ranks"]], [0, 1])
        # Same init, same first batch: the first loss is the same number.
        self.assertEqual(r["results"]["muond"]["loss_first"], r["results"]["torch"]["loss_first"])
        plan = r["results"]["muond"]["plan"]
        self.assertNotIn("error", plan)
        self.assertEqual(len(plan["rank_load"]), 2)
        self.assertTrue(all(v > 0 for v in plan["rank_load"]), plan)
        q = r["ratios"]
        self.assertAlmostEqual(q["opt_ms_torch_over_muond"], r["results"]["torch"]["opt_step_ms"]
                               / r["results"]["muond"]["opt_step_ms"])
        self.assertIsNone(q["tokens_per_s_muond_over_muonium"])
        # The daemons' state (GetStatus state_bytes), independently: fp32 momentum per
        # block-matrix element, fp32 exp_avg + exp_avg_sq per other element; fsdp
        # shards every param over the 2 daemons, tp replicates the norms.
        params = r["model"]["params"]
        expect = (4 * params["block_matrices"] + 8 * params["others"]) / 2**30
        state = sum(x["daemon"]["state_gib"] for x in r["results"]["muond"]["ranks"])
        if parallel == "fsdp":
            self.assertAlmostEqual(state, expect, delta=1e-12)
        else:
            self.assertGreaterEqual(state, expect - 1e-12)
        self.assertEqual(r["results"]["muond"]["daemon_state_gib"], max(
            x["daemon"]["state_gib"] for x in r["results"]["muond"]["ranks"]))
        self.assertNotIn("daemon_state_gib", r["results"]["torch"])
        cmp = r["params_muond_vs_torch"]
        self.assertEqual(cmp["worst_ref_change"], cmp["per_tensor"][cmp["worst"]]["ref_change"])
        self.assertEqual(len(cmp["per_tensor"]), 3 + 9 * 2)  # emb, norm, head; 9 per block
        for name, t in cmp["per_tensor"].items():
            self.assertLessEqual(t["rel_diff"], TOLERANCE, name)
            self.assertGreaterEqual(t["ref_change"], 10 * TOLERANCE, name)  # it trained

    def test_fsdp_and_tp_match_torch_muon(self):
        fsdp, out = self.run_bench("fsdp")
        self.check_report(fsdp, "fsdp", dp=2, tp=1)
        tp, _ = self.run_bench("tp")
        self.check_report(tp, "tp", dp=1, tp=2)
        proc = subprocess.run([sys.executable, REPORT, out], capture_output=True, text=True,
                              timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        rows = [line for line in proc.stdout.splitlines() if line.startswith(("| fsdp ", "| tp "))]
        self.assertEqual(len(rows), 2, proc.stdout)
        ratio = f"{fsdp['ratios']['tokens_per_s_muond_over_torch']:.3f}"
        self.assertIn(f" {ratio} ", rows[0])

    def test_kv_heads_not_divisible_by_tp_is_refused(self):
        e = dict(env(), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
        proc = subprocess.run([sys.executable, BENCH, "--model", "tiny", "--kv-heads", "1",
                               "--parallel", "tp", "--optimizers", "torch", "--out", self.tmp],
                              capture_output=True, text=True, timeout=60, env=e)
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn("--parallel tp: the 1 kv heads of --model tiny (--kv-heads) are not "
                      "divisible by the TP size 2", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        # muond without its servers: refused naming `muond launch`.
        proc = subprocess.run([sys.executable, BENCH, "--model", "tiny", "--parallel", "fsdp",
                               "--optimizers", "muond,torch", "--out", self.tmp],
                              capture_output=True, text=True, timeout=60, env=e)
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn("run under `muond launch", proc.stderr)
        # The defaults' trap: --model 1b (the default) on CPU.
        proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--optimizers",
                               "torch", "--out", self.tmp],
                              capture_output=True, text=True, timeout=60, env=e)
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn("--model 1b on CPU", proc.stderr)
        self.assertIn("pass --model tiny", proc.stderr)
        # A missing --muonium-path with muonium to run, on CPU too (where muonium is
        # skipped, so nothing else would notice).
        missing = os.path.join(self.tmp, "nope")
        proc = subprocess.run([sys.executable, BENCH, "--model", "tiny", "--device", "cpu",
                               "--optimizers", "torch,muonium", "--muonium-path", missing,
                               "--out", self.tmp],
                              capture_output=True, text=True, timeout=60, env=e)
        self.assertEqual(proc.returncode, 2, proc.stdout + proc.stderr)
        self.assertIn(f"--muonium-path {missing}: no such directory", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)


def import_bench():
    spec = importlib.util.spec_from_file_location("llama_train_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
