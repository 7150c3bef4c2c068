"""Several live muond.torch.Muon optimizers in one process, each its own
optimizer instance on the same two host daemons (split mode, 1 x 2):

* two optimizers on two models, stepped in turn, each match
  torch.optim.Muon / AdamW stepping its own model;
* an optimizer made after another one was closed, while a third is live,
  matches torch too;
* the second optimizer's state_dict round trip (torch.save, a new optimizer
  of another name, load_state_dict) continues bitwise as the uninterrupted
  run, while the first optimizer is live;
* a name a live trainer of another process holds is refused naming the
  instance, while other names work;
* muonctl's --optimizer reaches one instance: status and daemons show its
  coordinator job and plan, unregister drops it from every daemon and leaves
  the default instance registered.
"""
import glob
import io
import os
import re
import subprocess
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (REL_TOL, ClusterTestCase, Tiny, TorchReference, batch,  # noqa: E402
                    bitwise_mismatches, load_params, muond_tiny_opt, params_of,
                    rel_diff, tiny_groups, train)
from muond.client import ALREADY_REGISTERED, Client, MuondError  # noqa: E402

# Another trainer process: registers optimizer instance argv[3], steps once,
# says so, then waits to be killed.
_HOLDER = r"""
import sys, time
import torch
from muond.torch import Muon
daemons, job, name = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
w = torch.nn.Parameter(torch.ones(8, 4))
opt = Muon([{"params": [w], "param_names": ["w"]}], lr=0.02, daemons=daemons, job_id=job,
           tp_size=len(daemons), rpc_timeout=30, wait_healthy_timeout=30, name=name,
           token=sys.argv[4] or None)
w.grad = torch.ones(8, 4)
opt.step()
print("stepped", flush=True)
time.sleep(120)
"""


class SeveralOptimizersTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def opt(self, model, name=None):
        """An optimizer of its own instance: name=None takes the process's
        next deterministic name (never the default one: the first optimizer
        of this process is made in setUpClass)."""
        return muond_tiny_opt(self.cluster, model, name=name)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # The process's first optimizer takes the default instance "" and
        # keeps it for the whole class, so every later one is a second.
        cls.first_model = Tiny(seed=9)
        cls.first = muond_tiny_opt(cls.cluster, cls.first_model, name=None)

    @classmethod
    def tearDownClass(cls):
        cls.first.close()
        super().tearDownClass()

    def instances(self):
        with Client(self.cluster.daemons[0], timeout=30, token=self.cluster.token) as c:
            return list(c.status().optimizers)

    def expect_matches_torch(self, model, opt, steps, first=1):
        """`opt` stepping `model` for `steps` against torch on a copy."""
        reference = Tiny()
        load_params(reference, params_of(model))
        torch_opt = TorchReference(tiny_groups(reference))
        train(model, opt, steps, first)
        train(reference, torch_opt, steps, first)
        for n, want in params_of(reference).items():
            self.assertLessEqual(rel_diff(params_of(model)[n], want), REL_TOL, n)

    def test_first_optimizer_is_the_default_instance(self):
        self.assertEqual(self.first.name, "")
        self.assertIn("", self.instances())

    def test_two_live_optimizers_on_two_models_each_match_torch(self):
        a, b = Tiny(seed=1), Tiny(seed=2)
        opt_a, opt_b = self.opt(a), self.opt(b)
        try:
            self.assertNotIn(opt_a.name, ("", opt_b.name))
            self.assertTrue(opt_b.name.startswith("opt-"), opt_b.name)
            self.assertLessEqual({"", opt_a.name, opt_b.name}, set(self.instances()))
            want_a, want_b = Tiny(), Tiny()
            load_params(want_a, params_of(a))
            load_params(want_b, params_of(b))
            torch_a = TorchReference(tiny_groups(want_a))
            torch_b = TorchReference(tiny_groups(want_b))
            for step in (1, 2, 3):  # in turn, as a GAN steps its two models
                for model, opt in ((a, opt_a), (b, opt_b), (want_a, torch_a),
                                   (want_b, torch_b)):
                    train(model, opt, 1, first=step)
        finally:
            opt_a.close()
            opt_b.close()
        for got, want in ((a, want_a), (b, want_b)):
            for n, value in params_of(want).items():
                self.assertLessEqual(rel_diff(params_of(got)[n], value), REL_TOL, n)
        # Closing removed both instances from the daemons.
        self.assertNotIn(opt_a.name, self.instances())
        self.assertNotIn(opt_b.name, self.instances())

    def test_an_optimizer_made_after_another_was_closed_matches_torch(self):
        self.opt(Tiny(seed=3)).close()
        model = Tiny(seed=4)
        opt = self.opt(model)
        try:
            self.expect_matches_torch(model, opt, 2)
        finally:
            opt.close()

    def test_state_dict_round_trip_of_a_second_optimizer_is_bitwise(self):
        model = Tiny(seed=5)
        opt = self.opt(model, name="second")
        try:
            train(model, opt, 2)
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            snapshot = params_of(model)
            train(model, opt, 2, first=3)
            want = params_of(model)
        finally:
            opt.close()
        resumed = Tiny()
        load_params(resumed, snapshot)
        opt = self.opt(resumed, name="second-resumed")
        try:
            buf.seek(0)
            opt.load_state_dict(torch.load(buf, weights_only=False))
            train(resumed, opt, 2, first=3)
        finally:
            opt.close()
        self.assertEqual(bitwise_mismatches(params_of(resumed), want), [])
        # The first optimizer kept its own state meanwhile: it still steps.
        x, _ = batch(1)
        self.first_model(x).sum().backward()
        self.first.step()

    def expect_name_is_free(self, name, seed):
        """An optimizer named `name` on the same daemons registers and
        matches torch for a step."""
        model = Tiny(seed=seed)
        opt = self.opt(model, name=name)
        try:
            self.expect_matches_torch(model, opt, 1)
        finally:
            opt.close()

    def muonctl(self, *args):
        from cluster import _find_binary
        token = ([f"--token_file={os.path.join(self.cluster.tmp, 'token')}"]
                 if self.cluster.token else [])
        return subprocess.run(
            [_find_binary("tools/muonctl/muonctl"), *args, "--coordinator",
             self.cluster.coordinator, "--job_id", self.cluster.job_id, *token],
            capture_output=True, text=True, timeout=60)

    def optimizers_on_daemons(self):
        """Each daemon's optimizer instances (GetStatus)."""
        out = []
        for address in self.cluster.daemons:
            with Client(address, token=self.cluster.token) as client:
                out.append(sorted(client.status().optimizers))
        return out

    def test_muonctl_optimizer_flag_reaches_one_instance(self):
        model = Tiny(seed=7)
        opt = self.opt(model, name="tools")
        try:
            self.expect_matches_torch(model, opt, 1)
            status = self.muonctl("status", "--optimizer", "tools")
            self.assertEqual(status.returncode, 0, status.stderr)
            self.assertIn(f"job {self.cluster.job_id}/tools at", status.stdout)
            self.assertIn("plan version", status.stdout)
            daemons = self.muonctl("daemons", "--optimizer", "tools")
            self.assertEqual(daemons.returncode, 0, daemons.stderr)
            self.assertEqual(daemons.stdout.count("  yes"), self.NUM_DAEMONS, daemons.stdout)
            bad = self.muonctl("status", "--optimizer", "no/such")
            self.assertEqual(bad.returncode, 2)
            self.assertIn("--optimizer", bad.stderr)
            # (Other tests' instances may be there too: a killed holder's.)
            self.assertTrue(all({"", "tools"} <= set(names)
                                for names in self.optimizers_on_daemons()))
            gone = self.muonctl("unregister", "--optimizer", "tools")
            self.assertEqual(gone.returncode, 0, gone.stderr)
            self.assertEqual(gone.stdout.count("unregistered"), self.NUM_DAEMONS)
            self.assertTrue(all("" in names and "tools" not in names
                                for names in self.optimizers_on_daemons()))
        finally:
            opt.close()
        # The default instance (this process's first optimizer) still steps.
        x, _ = batch(1)
        self.first_model(x).sum().backward()
        self.first.step()

    def test_a_squatted_instance_job_is_refused_by_the_trainer_deadline(self):
        """Another set of daemons holds "<job>/squatted" on the coordinator
        (here: a client re-joining it with another world size): a trainer's
        optimizer of that name fails within its rpc_timeout, naming the
        instance and the fix, while other names register meanwhile."""
        import threading
        import time

        import grpc
        from muond.v1 import muond_pb2 as pb
        from muond.v1 import muond_pb2_grpc as pb_grpc
        stop = threading.Event()
        join = pb.JoinRequest(job_id=f"{self.cluster.job_id}/squatted", rank=0,
                              world_size=self.NUM_DAEMONS + 1, host="squatter",
                              device="cpu", address="unix:///nonexistent",
                              token=self.cluster.token or "")

        def squat():
            with grpc.insecure_channel(self.cluster.coordinator) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                while not stop.is_set():
                    try:
                        stub.Join(join, timeout=5)
                    except grpc.RpcError:
                        pass  # already joined and live: it holds the job
                    stop.wait(0.3)
        squatter = threading.Thread(target=squat)
        squatter.start()
        try:
            time.sleep(0.5)
            t0 = time.monotonic()
            with self.assertRaises(MuondError) as caught:
                muond_tiny_opt(self.cluster, Tiny(seed=8), name="squatted", rpc_timeout=8)
            self.assertLess(time.monotonic() - t0, 8 + 2)
            message = str(caught.exception)
            self.assertIn("optimizer 'squatted'", message)
            self.assertIn(f"job '{self.cluster.job_id}/squatted'", message)
            self.assertIn("another name (muond.torch.Muon(name=...))", message)
            self.expect_name_is_free("free", seed=8)
        finally:
            stop.set()
            squatter.join()

    def test_a_name_held_by_another_live_trainer_is_refused_naming_it(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, ",".join(self.cluster.daemons),
             self.cluster.job_id, "shared", self.cluster.token or ""],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertIn("stepped", holder.stdout.readline())
            with self.assertRaises(MuondError) as caught:
                self.opt(Tiny(seed=6), name="shared")
            self.assertEqual(caught.exception.reason, ALREADY_REGISTERED)
            self.assertIn("optimizer instance 'shared'", str(caught.exception))
            self.assertIn(f"-{holder.pid}-", caught.exception.metadata["client_id"])
            self.expect_name_is_free("not-shared", seed=6)
        finally:
            holder.kill()
            holder.communicate()
            # A killed trainer never unlinks its shm objects (muond.shm names).
            job = re.sub(r"[^A-Za-z0-9_.-]", "_", self.cluster.job_id)
            for path in glob.glob(f"/dev/shm/muond-{job}-{holder.pid}-*"):
                os.unlink(path)


if __name__ == "__main__":
    unittest.main()
