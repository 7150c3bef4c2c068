"""Which environment starts a local cluster and which rank a launched trainer
without $RANK has (muond.torch.discovery), in-process, no server: nothing
naming a daemon -> local mode; any launcher, torchrun or Slurm variable, or
$MUOND_LOCAL=0 -> none; a one-rank `muond launch` -> rank 0 and its socket; a
launch of 2 ranks without $RANK -> the error naming 2 and torchrun."""
import unittest

from muond.torch import discovery

ONE_RANK_LAUNCH = {"MUOND_SOCKET_DIR": "/run/muond-j-x", "MUOND_JOB_ID": "j",
                   "MUOND_NNODES": "1", "MUOND_NPROC_PER_NODE": "1"}


class LocalModeEnvTest(unittest.TestCase):
    def test_nothing_naming_a_daemon_wants_a_local_cluster(self):
        self.assertTrue(discovery.wants_local_cluster({"PATH": "/bin", "MUOND_BIN_DIR": "/x"}))
        self.assertTrue(discovery.wants_local_cluster({"MUOND_LOCAL": "1"}))

    def test_a_job_variable_or_muond_local_0_wants_none(self):
        for key in discovery.JOB_VARIABLES:
            self.assertFalse(discovery.wants_local_cluster({key: "0"}), key)
        self.assertFalse(discovery.wants_local_cluster({"MUOND_LOCAL": "0"}))

    def test_muond_local_other_than_0_or_1_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"\$MUOND_LOCAL='yes' must be 0 .* or 1"):
            discovery.wants_local_cluster({"MUOND_LOCAL": "yes"})

    def test_one_rank_launch_without_rank_is_rank_0(self):
        self.assertEqual(discovery.env_rank(ONE_RANK_LAUNCH), 0)
        found = discovery.discover(env=ONE_RANK_LAUNCH)
        self.assertEqual(found.rank, 0)
        self.assertEqual(found.address, "unix:///run/muond-j-x/muond-j-0.sock")
        self.assertEqual(discovery.env_rank(dict(ONE_RANK_LAUNCH, RANK="0")), 0)

    def test_launch_of_two_ranks_without_rank_names_the_world_and_torchrun(self):
        env = dict(ONE_RANK_LAUNCH, MUOND_NPROC_PER_NODE="2")
        self.assertIsNone(discovery.env_rank(env))
        with self.assertRaisesRegex(ValueError, r"muond launch started 2 daemons .* \$RANK is "
                                    r"unset: run the 2 ranks with torchrun"):
            discovery.discover(env=env)

    def test_no_launch_and_no_rank_names_every_way_and_muond_local(self):
        with self.assertRaisesRegex(ValueError, r"needs its daemon: pass daemons=.*"
                                    r"\$MUOND_LOCAL=0 turned off"):
            discovery.discover(env={"MUOND_LOCAL": "0"})


if __name__ == "__main__":
    unittest.main()
