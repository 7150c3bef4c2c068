"""Which environment starts a local cluster and which rank a launched trainer
without $RANK has (muond.torch.discovery), in-process, no server: nothing
naming a daemon -> local mode; any launcher, torchrun or Slurm variable, or
$MUOND_LOCAL=0 -> none, $MUOND_LOCAL=1 -> one all the same; a one-rank `muond
launch` -> rank 0 and its socket; a launch of 2 ranks without $RANK -> the
error naming 2 and torchrun; a stray job variable -> the error naming it and
the fixes; the local cluster's socket directory under the first base short
enough for a Unix socket path, or the error naming each and $TMPDIR."""
import os
import tempfile
import unittest
from unittest import mock

import torch

import muond.local
from muond.launch.config import MAX_SOCKET_PATH
from muond.launch.errors import LaunchError
from muond.torch import Muon, discovery

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

    def test_muond_local_1_wants_one_despite_a_job_variable(self):
        for key in discovery.JOB_VARIABLES:
            self.assertTrue(discovery.wants_local_cluster({key: "0", "MUOND_LOCAL": "1"}), key)

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



class SocketDirTest(unittest.TestCase):
    def test_no_base_short_enough_names_each_the_limit_and_tmpdir(self):
        bases = ["/" + "a" * 80, "/" + "b" * 90]
        with self.assertRaises(LaunchError) as caught:
            muond.local.socket_dir(bases)
        message = str(caught.exception)
        self.assertIn(f"within {MAX_SOCKET_PATH} bytes, a Unix socket path's limit", message)
        for base in bases:
            socket = os.path.join(base, "muond-local-12345678", "coordinator.sock")
            self.assertIn(f"{base} ({len(socket)} bytes)", message)
        self.assertIn("Set $TMPDIR to a short writable directory", message)

    def test_the_first_base_short_enough_wins(self):
        with tempfile.TemporaryDirectory() as short:
            made = muond.local.socket_dir(["/" + "a" * 90, short])
            self.assertEqual(os.path.dirname(made), short)
            self.assertEqual(os.stat(made).st_mode & 0o777, 0o700)


class StrayJobVariableTest(unittest.TestCase):
    """A job variable left in a plain script's environment (a shell, a
    notebook, an IDE) keeps the local cluster from starting; the error then
    names it and the three fixes."""

    def assert_names_fixes(self, message, names, pronoun):
        self.assertIn(f"because {names} ", message)
        self.assertIn(f"In a plain script, unset {pronoun}", message)
        self.assertIn("run it under muond launch", message)
        self.assertIn("set MUOND_LOCAL=1 to start the local cluster anyway", message)

    def test_a_stray_local_rank_is_named_with_the_fixes(self):
        with self.assertRaises(ValueError) as caught:
            discovery.discover(env={"LOCAL_RANK": "0", "PATH": "/bin"})
        self.assertIn("needs its daemon", str(caught.exception))
        self.assert_names_fixes(str(caught.exception), "$LOCAL_RANK='0' is set", "it")

    def test_several_stray_variables_are_all_named(self):
        with self.assertRaises(ValueError) as caught:
            discovery.discover(env={"WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        self.assert_names_fixes(str(caught.exception),
                                "$WORLD_SIZE='1', $LOCAL_RANK='0' are set", "them")

    def test_a_stray_rank_names_it_beside_the_missing_socket(self):
        with tempfile.TemporaryDirectory() as runtime:
            found = discovery.discover(env={"RANK": "0", "XDG_RUNTIME_DIR": runtime})
            message = found.missing_socket()
        self.assertIn(f"no daemon socket at {runtime}/muond/muond-default-0.sock", message)
        self.assert_names_fixes(message, "$RANK='0' is set", "it")

    def test_a_job_of_several_ranks_is_not_told_to_set_muond_local(self):
        # torchrun without muond launch: one private daemon per process would not
        # form one job, so MUOND_LOCAL=1 is no fix there; and set, it says so.
        env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
        with tempfile.TemporaryDirectory() as runtime:
            message = discovery.discover(env=dict(env, XDG_RUNTIME_DIR=runtime)).missing_socket()
            self.assertIn("run it under muond launch", message)
            self.assertNotIn("MUOND_LOCAL=1", message)
            found = discovery.discover(env=dict(env, MUOND_LOCAL="1", XDG_RUNTIME_DIR=runtime))
            message = found.missing_socket()
        self.assertIn("$MUOND_LOCAL=1 does not apply to a job of several processes", message)

    def test_no_note_under_muond_launch_or_with_muond_local(self):
        env = dict(ONE_RANK_LAUNCH, MUOND_NPROC_PER_NODE="2")
        with self.assertRaises(ValueError) as caught:
            discovery.discover(env=env)
        self.assertNotIn("MUOND_LOCAL=1", str(caught.exception))
        with self.assertRaises(ValueError) as caught:
            discovery.discover(env={"LOCAL_RANK": "0", "MUOND_LOCAL": "0"})
        self.assertNotIn("MUOND_LOCAL=1", str(caught.exception))

    def test_muon_names_the_stray_variable_before_starting_anything(self):
        clean = {k: v for k, v in os.environ.items()
                 if k not in discovery.JOB_VARIABLES and k != "MUOND_LOCAL"}
        w = torch.nn.Parameter(torch.zeros(4, 4))
        with mock.patch.dict(os.environ, {**clean, "LOCAL_RANK": "0"}, clear=True):
            with self.assertRaisesRegex(ValueError, r"because \$LOCAL_RANK='0' is set .*"
                                        r"MUOND_LOCAL=1"):
                Muon([w], lr=0.02)


if __name__ == "__main__":
    unittest.main()
