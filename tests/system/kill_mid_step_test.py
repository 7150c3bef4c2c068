"""A daemon SIGKILLed mid-step in the torchrun main job, on CPU:
tests/system/kill_mid_step.py through `muond launch` with host-mode daemons
and gloo trainers:
* FSDP2 on 2 ranks, the victim's daemon killed between its exchanges and
  the commit vote (--kill-at commit);
* FSDP2 x TP on 4 ranks (a 2 x 2 mesh: the victim, rank 1, shares a TP
  group with rank 0 and an FSDP group with rank 3, none with rank 2),
  killed while every survivor's daemon waits for it inside the step
  (--kill-at collective).
The script's checks (its docstring: the kill landed inside the step, every
survivor's opt.step() raised PEER_GONE naming the dead rank, params and
optimizer state bitwise unchanged, `muond launch` exited 1 naming the
daemon, nothing left) must all pass; and its bitwise comparison must see a
one-bit change, so a "nothing changed" cannot come from a comparison that
sees nothing. Cheap ones (no job started): options that cannot run the check
are refused up front, naming the option and its rule; the landing check
passes only with the daemons' log evidence that the kill came before any
rank could commit (a kill after the commit window, the reviewer's repro with
--commit-delay-ms 1, is a FAIL).
"""
import contextlib
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

from tests.common.launched import bin_dir  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(HERE, "kill_mid_step.py")
sys.path.insert(0, HERE)
import kill_mid_step  # noqa: E402
from mid_step_kill import landing, shared  # noqa: E402


class KillMidStepTest(unittest.TestCase):
    def run_script(self, *args: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="kmst-", dir="/tmp") as tmp:
            out = os.path.join(tmp, "result.json")
            proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--bin-dir",
                                   bin_dir(), "--out", out, *args],
                                  capture_output=True, text=True, timeout=400)
            print(proc.stdout[-6000:], file=sys.stderr)
            self.assertTrue(os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:])
            with open(out) as f:
                result = json.load(f)
        failed = [c for c in result["checks"] if not c["ok"]]
        self.assertEqual(failed, [])
        self.assertEqual((proc.returncode, result["verdict"]), (0, "PASS"))
        return result

    def test_fsdp_two_ranks_killed_before_the_commit(self):
        result = self.run_script("--nproc", "2", "--parallel", "fsdp")
        survivor = result["ranks"]["0"]
        self.assertEqual(survivor["error"]["metadata"], {"step_id": "3"})
        self.assertGreater(survivor["num_state_entries"], 0)

    def test_fsdp_tp_four_ranks_killed_while_peers_wait(self):
        result = self.run_script("--nproc", "4", "--parallel", "fsdp+tp", "--victim", "1",
                                 "--kill-at", "collective")
        self.assertEqual(sorted(result["ranks"]), ["0", "1", "2", "3"])
        self.assertEqual(result["ranks"]["1"]["kill"]["markers"],
                         [f"rank {r}: testonly_commit_delay_ms: step 3: started"
                          for r in (0, 2, 3)])

    def refusal(self, *argv: str) -> str:
        """parse_args's error for argv (it must refuse: exit status 2)."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
            kill_mid_step.parse_args(list(argv))
        self.assertEqual(cm.exception.code, 2, err.getvalue())
        return err.getvalue()

    def test_bad_options_refused_up_front(self):
        floor = shared.MIN_COMMIT_DELAY_MS
        cases = {
            ("--steps", "0"): "--steps 0: needs >= 1",
            ("--steps", "-1"): "--steps -1: needs >= 1",
            ("--kill-at", "commit", "--commit-delay-ms", "0"):
                f"--commit-delay-ms 0 with --kill-at commit: must be in [{floor}, 5000]",
            ("--commit-delay-ms", str(floor - 1)):
                f"--commit-delay-ms {floor - 1} with --kill-at commit: must be in [{floor},",
            ("--commit-delay-ms", "5001"): "--commit-delay-ms 5001 with --kill-at commit",
            ("--kill-at", "collective", "--commit-delay-ms", "0"):
                "--commit-delay-ms 0 with --kill-at collective: needs >= 1",
            ("--nproc", "3", "--parallel", "fsdp+tp"):
                "--nproc must be a multiple of 2; pass `--nproc 2` or `--nproc 4` instead",
            ("--nproc", "4", "--parallel", "hsdp", "--inner", "0"): "--inner 0: needs >= 1",
            ("--nproc", "1"): "--nproc 1: needs >= 2",
            ("--victim", "2"): "--victim 2: must be a rank of --nproc 2",
            ("--comm-timeout-s", "30"): "--comm-timeout-s 30: must be in [1, 30)",
            ("--timeout", "49"): "--timeout 49: needs >= --comm-timeout-s + 30 = 50 s",
        }
        for argv, want in cases.items():
            with self.subTest(argv=argv):
                message = self.refusal(*argv)
                self.assertIn(want, message)
                self.assertNotIn("torchrun --nproc-per-node", message)
        # Every problem at once, not the first only.
        message = self.refusal("--steps", "0", "--nproc", "3", "--parallel", "hsdp")
        self.assertIn("--steps 0", message)
        self.assertIn("--nproc must be a multiple of 2", message)
        # What fits is taken: the floor itself, the layouts of the CI runs.
        self.assertEqual(kill_mid_step.parse_args(["--commit-delay-ms", str(floor)])
                         .commit_delay_ms, floor)
        a = kill_mid_step.parse_args(["--nproc", "4", "--parallel", "fsdp+tp",
                                      "--kill-at", "collective", "--timeout", "50"])
        self.assertEqual((a.victim, a.commit_delay_ms), (3, 1))
        # The script itself refuses before its banner (which names the job).
        proc = subprocess.run([sys.executable, SCRIPT, "--nproc", "3", "--parallel", "fsdp+tp"],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual((proc.returncode, proc.stdout), (2, ""))
        self.assertIn("--nproc must be a multiple of 2", proc.stderr)

    def test_landing_needs_the_daemons_log_evidence(self):
        exchanged = shared.EXCHANGED.format(step=3)
        started = shared.STARTED.format(step=3)
        t = datetime.datetime(2026, 12, 2, 7, 56, 5, 187769,
                              tzinfo=datetime.timezone.utc).timestamp()

        def log(message: str) -> str:
            return ("I20261202 07:56:05.100000 31963 daemon_core.cc:429] plan version 1 active\n"
                    f"I20261202 07:56:05.187769 31963 layer_sharded_muon.cc:725] {message}\n")

        def commit(wait_ms: int, after_s: float, **kill) -> bool:
            logs = {0: "", 1: log(f"{exchanged}; waiting {wait_ms} ms before the commit vote")}
            record = {"killed": True, "step_id": 3, "kill_at": t + after_s,
                      "rpc_done_at_kill": False, **kill}
            return landing.landing("commit", record, 1, logs)[0]

        self.assertTrue(commit(1000, 0.005))
        self.assertTrue(commit(200, 0.199))
        self.assertFalse(commit(1000, 1.0005))  # after the wait: it may have committed
        self.assertFalse(commit(1, 0.0041))  # the reviewer's --commit-delay-ms 1 run
        self.assertFalse(commit(1000, 0.005, rpc_done_at_kill=True))  # the reply came
        self.assertFalse(commit(1000, 0.005, killed=False))
        self.assertFalse(commit(1000, -0.001))  # before the line: not this step's window
        self.assertFalse(landing.landing(
            "commit", {"killed": True, "step_id": 3, "kill_at": t, "rpc_done_at_kill": False},
            1, {0: "", 1: log(shared.EXCHANGED.format(step=2) + "; waiting 1000 ms")})[0])

        def collective(victim_log: str, after_s: float, survivor_logs=None) -> bool:
            logs = {0: log(started), 2: log(started), **(survivor_logs or {}), 1: victim_log}
            record = {"killed": True, "step_id": 3, "kill_at": t + after_s,
                      "rpc_sent_at": t + after_s + 0.001}
            return landing.landing("collective", record, 1, logs)[0]

        self.assertTrue(collective("", 0.2))
        self.assertFalse(collective(log(started), 0.2))  # the victim's daemon began it too
        self.assertFalse(collective("", -0.01))  # killed before the survivors started
        self.assertFalse(collective("", 0.2, {2: ""}))  # a survivor never started

    def test_comparison_sees_one_bit(self):
        a = torch.tensor([1.0, 0.0, 2.5])
        flipped = a.clone()
        flipped.view(torch.int32)[2] ^= 1  # the last mantissa bit
        self.assertEqual(shared.differing({"p": a}, {"p": a.clone()}), [])
        self.assertEqual(shared.differing({"p": a}, {"p": flipped}), ["p"])
        self.assertEqual(shared.differing({"p": a}, {"p": torch.tensor([1.0, -0.0, 2.5])}),
                         ["p"])
        self.assertEqual(shared.differing({"p": a}, {"q": a}), ["p", "q"])


if __name__ == "__main__":
    unittest.main()
