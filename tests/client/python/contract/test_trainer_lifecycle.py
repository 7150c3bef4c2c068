"""A trainer that ends without ``opt.close()`` must not lock the daemons
(resuming in a new process after a crash or preemption is why one
checkpoints). A trainer subprocess registers and steps, then ends without
close(): a normal exit or an uncaught exception unregisters (the finalizer
runs at interpreter exit); after SIGKILL the next trainer finds the holder's
process gone and takes over; a live holder is refused with
ALREADY_REGISTERED and a message naming ``takeover=True``, which clears it.
The new trainer's first step then equals torch.optim.Muon's from scratch."""
import glob
import os
import re
import signal
import subprocess
import sys
import time
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REL_TOL, ClusterTestCase, TorchReference, muon_group, muond_opt, rel_diff  # noqa: E402
from muond.client import ALREADY_REGISTERED, MuondError  # noqa: E402

# The earlier trainer: registers, steps once, says so, then ends as argv[3] says.
_TRAINER = r"""
import os, signal, sys, time
import torch
from muond.torch import Muon
daemons, job, how = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
w = torch.nn.Parameter(torch.ones(8, 4))
opt = Muon([{"params": [w], "param_names": ["w"]}], lr=0.02, daemons=daemons, job_id=job,
           tp_size=len(daemons), rpc_timeout=30, wait_healthy_timeout=30)
w.grad = torch.ones(8, 4)
opt.step()
print("stepped", flush=True)
if how == "raise":
    raise RuntimeError("a bug in the training loop")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "hang":
    time.sleep(120)
"""


class TrainerLifecycleTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def _trainer(self, how: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAINER, ",".join(self.cluster.daemons),
             self.cluster.job_id, how], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.addCleanup(self._unlink_shm_of, proc)
        return proc

    def _unlink_shm_of(self, proc: subprocess.Popen) -> None:
        """A killed trainer never unlinks its shm objects (muond.shm names them
        /muond-<job>-<pid>-...): remove them so the test leaves /dev/shm as
        it found it."""
        proc.kill()
        proc.wait()
        job = re.sub(r"[^A-Za-z0-9_.-]", "_", self.cluster.job_id)
        for path in glob.glob(f"/dev/shm/muond-{job}-{proc.pid}-*"):
            os.unlink(path)

    def _run_trainer(self, how: str) -> None:
        proc = self._trainer(how)
        out, err = proc.communicate(timeout=60)
        self.assertIn("stepped", out, err)

    def _new_trainer_matches_torch(self, **kw) -> None:
        """A new optimizer registers on the daemons and its first step is
        torch.optim.Muon's first step (nothing of the old trainer's state)."""
        initial = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
        grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(4))
        out = {}
        for side in ("torch", "muond"):
            w = torch.nn.Parameter(initial.clone())
            groups = [muon_group([w], ["w"])]
            opt = (TorchReference(groups) if side == "torch" else
                   muond_opt(self.cluster, groups, **kw))
            try:
                w.grad = grad.clone()
                opt.step()
            finally:
                opt.close()
            out[side] = w.detach().clone()
        self.assertFalse(torch.equal(out["muond"], initial))
        self.assertLessEqual(rel_diff(out["muond"], out["torch"]), REL_TOL)

    def test_exit_without_close_unregisters(self):
        for how in ("exit", "raise"):
            with self.subTest(how=how):
                self._run_trainer(how)
                self._new_trainer_matches_torch()

    def test_a_killed_trainer_is_taken_over(self):
        proc = self._trainer("kill")
        proc.communicate(timeout=60)
        self.assertEqual(proc.returncode, -signal.SIGKILL)
        with self.assertLogs("muond.torch", "WARNING") as logs:
            self._new_trainer_matches_torch()
        self.assertIn("process on this host is gone", "\n".join(logs.output))

    def test_a_live_holder_is_refused_unless_taken_over(self):
        proc = self._trainer("hang")
        try:
            self.assertIn("stepped", proc.stdout.readline())
            w = torch.nn.Parameter(torch.zeros(8, 4))
            t0 = time.monotonic()
            with self.assertRaises(MuondError) as caught:
                muond_opt(self.cluster, [muon_group([w], ["w"])])
            self.assertLess(time.monotonic() - t0, 10)
            self.assertEqual(caught.exception.reason, ALREADY_REGISTERED)
            self.assertIn(f"-{proc.pid}-", caught.exception.metadata["client_id"])
            self.assertIn("takeover=True", str(caught.exception))
            self._new_trainer_matches_torch(takeover=True)
        finally:
            proc.kill()
            proc.communicate()

    def test_muonctl_unregister_clears_any_holder(self):
        from cluster import _find_binary
        proc = self._trainer("hang")
        try:
            self.assertIn("stepped", proc.stdout.readline())
            ctl = subprocess.run(
                [_find_binary("tools/muonctl/muonctl"), "unregister",
                 "--coordinator", self.cluster.coordinator, "--job_id", self.cluster.job_id,
                 "--token-file", os.path.join(self.cluster.tmp, "token")],
                capture_output=True, text=True, timeout=30)
            self.assertEqual(ctl.returncode, 0, ctl.stderr)
            self.assertEqual(ctl.stdout.count("unregistered"), self.NUM_DAEMONS)
            self._new_trainer_matches_torch()
        finally:
            proc.kill()
            proc.communicate()


if __name__ == "__main__":
    unittest.main()
