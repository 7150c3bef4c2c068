"""Local mode (one trainer rank per daemon) on real host daemons: a trainer
world smaller than the daemons' --world_size is refused before registering,
naming both sizes (GetStatus.world_size), instead of waiting for a plan; a
matching world registers, also for a process's second optimizer, whose
instance does not exist on the daemon before it registers."""
import os
import sys
import unittest
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ClusterTestCase  # noqa: E402

from muond.torch import Muon  # noqa: E402

_WORLD_KEYS = ("WORLD_SIZE", "SLURM_NTASKS", "MUOND_NNODES", "MUOND_NPROC_PER_NODE")


def local_muon(cluster, **kw):
    w = torch.nn.Parameter(torch.ones(4, 4))
    return w, Muon([{"params": [w], "param_names": ["w"]}], daemons=cluster.daemons[:1],
                   job_id=cluster.job_id, token=cluster.token, shard_mode="local",
                   wait_healthy_timeout=30, rpc_timeout=30, **kw)


def one_process_env():
    return mock.patch.dict(os.environ, {k: v for k, v in os.environ.items()
                                        if k not in _WORLD_KEYS}, clear=True)


class TwoDaemonsOneTrainerTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def test_refused_naming_both_world_sizes(self):
        with one_process_env():
            with self.assertRaisesRegex(ValueError, r"the daemons' world size is 2 \(daemon "
                                        r"rank 0's --world_size\) but this job runs 1 trainer "
                                        r"rank .*daemon rank 1 waiting for trainers"):
                local_muon(self.cluster)


class OneDaemonTwoOptimizersTest(ClusterTestCase):
    def test_a_second_optimizer_checks_the_daemon_world_too(self):
        with one_process_env():
            w1, first = local_muon(self.cluster)
            self.addCleanup(first.close)
            w2, second = local_muon(self.cluster)
            self.addCleanup(second.close)
        for w, opt in ((w1, first), (w2, second)):
            w.grad = torch.ones_like(w)
            opt.step()
            self.assertEqual(opt.step_id, 1)
            self.assertFalse(torch.equal(w, torch.ones(4, 4)))


if __name__ == "__main__":
    unittest.main()
