"""A daemon SIGKILLed mid-step in the torchrun main job (issue 19), on CPU:
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
sees nothing.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(HERE, "kill_mid_step.py")
sys.path.insert(0, HERE)
import kill_mid_step  # noqa: E402


def bin_dir() -> str:
    """The servers: Bazel's runfiles tree, else $MUOND_BIN_DIR."""
    if os.path.exists(os.path.join(RUNFILES, "server/daemon/muond-daemon")):
        return RUNFILES
    return os.environ["MUOND_BIN_DIR"]


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

    def test_comparison_sees_one_bit(self):
        a = torch.tensor([1.0, 0.0, 2.5])
        flipped = a.clone()
        flipped.view(torch.int32)[2] ^= 1  # the last mantissa bit
        self.assertEqual(kill_mid_step.differing({"p": a}, {"p": a.clone()}), [])
        self.assertEqual(kill_mid_step.differing({"p": a}, {"p": flipped}), ["p"])
        self.assertEqual(kill_mid_step.differing({"p": a}, {"p": torch.tensor([1.0, -0.0, 2.5])}),
                         ["p"])
        self.assertEqual(kill_mid_step.differing({"p": a}, {"q": a}), ["p", "q"])


if __name__ == "__main__":
    unittest.main()
