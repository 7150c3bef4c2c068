"""A daemon SIGKILLed mid-step in the torchrun main job (issue 19), on CPU:
tests/system/kill_mid_step.py through `muond launch` with host-mode daemons
and gloo trainers, FSDP2 on 2 ranks and FSDP2 x TP on 4 (a 2 x 2 mesh, so
the victim's daemon shares a TP group with one survivor and an FSDP group
with another). The script's checks (what its docstring lists: the kill
landed inside the step, every survivor's opt.step() raised PEER_GONE naming
the dead rank, params and optimizer state bitwise unchanged, `muond launch`
exited 1 naming the daemon, nothing left) must all pass; and its bitwise
comparison must see a one-bit change, so a "nothing changed" cannot come
from a comparison that sees nothing.
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

    def test_fsdp_two_ranks(self):
        result = self.run_script("--nproc", "2", "--parallel", "fsdp")
        survivor = result["ranks"]["0"]
        self.assertEqual(survivor["error"]["metadata"], {"step_id": "3"})
        self.assertGreater(survivor["num_state_entries"], 0)

    def test_fsdp_tp_four_ranks(self):
        result = self.run_script("--nproc", "4", "--parallel", "fsdp+tp", "--victim", "1")
        self.assertEqual(sorted(result["ranks"]), ["0", "1", "2", "3"])

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
