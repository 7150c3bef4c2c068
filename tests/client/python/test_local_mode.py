"""Local mode end to end (real servers): a plain `python train.py` with
muond.torch.Muon(params) and nothing naming a daemon starts its own
coordinator and daemon, steps like torch.optim.Muon (fp32 NS on both sides),
and leaves no server process and no directory after close(), after `del opt`
alone, and at interpreter exit; another lease on the cluster keeps it
running, the last release stops it, and a later optimizer starts a fresh
one; $MUOND_LOCAL=1 starts one although stray job variables are set;
$MUOND_LOCAL=0 gives the error naming what to set."""
import os
import unittest

from local_mode_runs import REL_TOL, run_trainer
from muond.launch.processes import is_alive

NOTHING_LEFT = {"alive": [], "directory_exists": False}


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

    def test_muond_local_1_starts_the_cluster_despite_stray_job_variables(self):
        info = run_trainer(self, "close", MUOND_LOCAL="1", LOCAL_RANK="0", WORLD_SIZE="4")
        self.check_stepped(info)
        self.assertEqual(info["after"], NOTHING_LEFT)

    def test_muond_local_0_gives_the_error_naming_what_to_set(self):
        info = run_trainer(self, "off", MUOND_LOCAL="0")
        self.assertIn("needs its daemon: pass daemons=", info["error"])
        self.assertIn("$MUOND_LOCAL=0 turned off", info["error"])
        self.assertFalse(info["cluster"])


if __name__ == "__main__":
    unittest.main()
