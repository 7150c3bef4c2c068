"""Local mode end to end (real servers): a plain `python train.py` with
muond.torch.Muon(params) and nothing naming a daemon starts its own
coordinator and daemon, steps like torch.optim.Muon (fp32 NS on both sides),
a model's named_parameters() with biases and a LayerNorm step like
torch.optim.Muon on its matrices and torch.optim.AdamW on the rest,
and leaves no server process and no directory after close(), after `del opt`
alone, and at interpreter exit; another lease on the cluster keeps it
running, the last release stops it, and a later optimizer starts a fresh
one; $MUOND_LOCAL=1 starts one although stray job variables are set; a
$TMPDIR too long for a socket path falls back to /tmp; a cluster whose
servers fail keeps their logs and names them; a step after the local daemon
was killed says so (its pid and signal) and what to do, changes nothing, and
a new optimizer after close() starts a fresh cluster; $MUOND_LOCAL=0 gives the
error naming what to set; client/python/README.md's recipe for an exact
comparison with torch.optim.Muon runs and agrees to fp32 rounding."""
import os
import re
import shutil
import subprocess
import sys
import unittest
from unittest import mock

import muond.local
from local_mode_runs import HERE, REL_TOL, output_dir, plain_env, run_trainer
from muond.launch.processes import is_alive

NOTHING_LEFT = {"alive": [], "directory_exists": False}
CLIENT_README = os.path.join(HERE, "..", "..", "..", "client", "python", "README.md")
EXACT_COMPARISON = "**An exact comparison with torch.optim.Muon.**"


class LocalModeTest(unittest.TestCase):
    def check_stepped(self, info):
        self.assertEqual(len(info["pids"]), 3)  # coordinator, daemon, reaper
        self.assertTrue(info["directory"])
        self.assertLess(info["rel_diff"], REL_TOL)

    def test_close_stops_the_servers_and_removes_the_directory(self):
        info = run_trainer(self, "close")
        self.check_stepped(info)
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_del_alone_stops_the_servers_and_removes_the_directory(self):
        info = run_trainer(self, "del")
        self.check_stepped(info)
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_interpreter_exit_stops_the_servers_and_removes_the_directory(self):
        info = run_trainer(self, "exit")
        self.check_stepped(info)
        self.assertEqual([p for p in info["pids"] if is_alive(p)], [])
        self.assertFalse(os.path.exists(info["directory"]))

    def test_the_last_lease_stops_the_cluster_and_a_later_optimizer_starts_one(self):
        info = run_trainer(self, "shared")
        self.check_stepped(info)
        self.assertEqual(info["after_close_with_other_lease"],
                         {"alive": info["pids"], "directory_exists": True})
        self.assertEqual(info["after"], NOTHING_LEFT)
        self.assertTrue(info["second_is_fresh"])
        self.assertEqual(info["second_stepped"], 1)
        self.assertEqual(info["second_after"], NOTHING_LEFT)

    def test_a_killed_local_daemon_is_named_and_a_new_optimizer_starts_afresh(self):
        info = run_trainer(self, "daemon_killed")
        self.assertIsNotNone(info["error"])
        self.assertIn(f"local muond-daemon (pid {info['daemon_pid']})", info["error"])
        self.assertRegex(info["error"], r"SIGKILL|signal 9")
        self.assertIn("close() every optimizer", info["error"])
        self.assertTrue(info["unchanged"])
        self.assertEqual(info["second_stepped"], 1)

    def test_named_parameters_of_a_model_with_biases_and_norms_step_like_muon_and_adamw(self):
        info = run_trainer(self, "model")
        self.assertEqual(info["groups"], [["muon", ["0.weight", "3.weight"]],
                                          ["adamw", ["0.bias", "1.weight", "1.bias"]]])
        for name, diff in info["rel_diff"].items():
            self.assertLess(diff, REL_TOL, name)
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_the_readme_recipe_for_an_exact_comparison_agrees_to_fp32_rounding(self):
        with open(CLIENT_README) as f:
            text = f.read()
        start = text.index(EXACT_COMPARISON)
        (recipe,) = re.findall(r"```python\n(.*?)```", text[start:text.index("\n\n**", start)],
                               re.S)
        out = output_dir(self)
        proc = subprocess.run([sys.executable, "-c", recipe], env=plain_env(), cwd=out,
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertLess(float(proc.stdout.split()[-1]), 1e-5, proc.stdout)

    def test_muond_local_1_starts_the_cluster_despite_stray_job_variables(self):
        info = run_trainer(self, "close", MUOND_LOCAL="1", LOCAL_RANK="0", WORLD_SIZE="4")
        self.check_stepped(info)
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_a_tmpdir_too_long_for_a_socket_falls_back_to_tmp(self):
        out = output_dir(self)
        long_tmpdir = os.path.join(out, "t" * 60, "u" * 40)
        os.makedirs(long_tmpdir)
        info = run_trainer(self, "close", TMPDIR=long_tmpdir)
        self.check_stepped(info)
        self.assertEqual(os.path.dirname(info["directory"]), "/tmp")
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_a_cluster_that_fails_to_start_keeps_and_names_its_logs(self):
        bin_dir = output_dir(self)
        for name in ("muond-coordinator", "muond-daemon"):
            with open(os.path.join(bin_dir, name), "w") as f:
                f.write(f"#!/bin/sh\necho '{name}: cannot listen (a stand-in that fails)' >&2\n"
                        "exit 3\n")
            os.chmod(os.path.join(bin_dir, name), 0o755)
        with mock.patch.dict(os.environ, {"MUOND_BIN_DIR": bin_dir, "PATH": "/usr/bin:/bin"}):
            with self.assertRaises(RuntimeError) as caught:
                muond.local.acquire(None, None, 30)
        message = str(caught.exception)
        self.assertIn("muond-coordinator: cannot listen (a stand-in that fails)", message)
        kept = re.search(r"the servers' logs are kept in (\S+);", message)
        self.assertIsNotNone(kept, message)
        self.addCleanup(shutil.rmtree, kept.group(1), ignore_errors=True)
        self.assertEqual(sorted(os.listdir(kept.group(1))),
                         ["muond-coordinator.log", "muond-daemon.log"])
        with open(os.path.join(kept.group(1), "muond-coordinator.log")) as f:
            self.assertIn("cannot listen", f.read())
        self.assertIsNone(muond.local.current())

    def test_muond_local_0_gives_the_error_naming_what_to_set(self):
        info = run_trainer(self, "off", MUOND_LOCAL="0")
        self.assertIn("needs its daemon: pass daemons=", info["error"])
        self.assertIn("$MUOND_LOCAL=0 turned off", info["error"])
        self.assertFalse(info["cluster"])


if __name__ == "__main__":
    unittest.main()
