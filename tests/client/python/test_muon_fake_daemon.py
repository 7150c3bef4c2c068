"""muond.torch.Muon through fake daemons (fake_daemon.py) equals the example's
in-process ReferenceMuon after 3 steps. The fake reconstructs full matrices
from the refs, tags and domains alone, so this checks the client's wire
contract independently of the C++ daemon."""
import os
import sys
import shutil
import tempfile
import threading
import time
import unittest
from unittest import mock

import grpc

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import pb, start_cluster  # noqa: E402
from muond.client import PEER_GONE, MuondError  # noqa: E402
from muond.torch import Muon  # noqa: E402
from muond.v1 import error_details_pb2  # noqa: E402
from reference_muon import ReferenceMuon  # noqa: E402

# name: (shape, tag partition_dim or None, algorithm)
PARAMS = {
    "w_pad_tp1": ((9, 8), 1, "muon"),      # TP along cols, 1 GTP pad row
    "w_tp0": ((8, 6), 0, "muon"),          # TP along rows, no pad
    "w_fallback": ((6, 8), 0, "muon"),     # dim 0 would need a pad -> dim 1
    "w_solo": ((6, 7), 0, "muon"),         # splits on neither dim -> one daemon
    "w_tall": ((12, 4), None, "muon"),     # untagged, rows > cols (transposed NS)
    "emb": ((11, 4), None, "adamw"),
    "bias": ((9,), None, "adamw"),
    "norm": ((4,), None, "adamw"),
}
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, eps=1e-15,
             coefficient_type="quintic", scale_mode="spectral", extra_scale_factor=0.2)


def make_params():
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, (shape, pd, _) in PARAMS.items():
        p = torch.nn.Parameter(torch.randn(shape, generator=g))
        if pd is not None:
            p.tensor_model_parallel, p.partition_dim = True, pd
        out[name] = p
    return out


def groups(params):
    muon = [n for n, v in PARAMS.items() if v[2] == "muon"]
    adamw = [n for n, v in PARAMS.items() if v[2] == "adamw"]
    return [dict(params=[params[n] for n in muon], param_names=muon),
            dict(params=[params[n] for n in adamw], param_names=adamw, algorithm="adamw",
                 lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)]


def run(opt, params, steps=3):
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        for p in params.values():
            # as backward would: accumulate into an existing grad, else create one
            (p * torch.randn(p.shape, generator=g)).sum().backward()
        for group in opt.param_groups:  # a schedule: exercises GroupOverride
            group["lr"] *= 0.5 if step == 2 else 1.0
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


class MuonFakeDaemonTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def start(self, world):
        self.cluster, self.addresses = start_cluster(self.dir, world)

    def tearDown(self):
        for d in self.cluster.daemons:
            d.stop()

    def compare(self, G, T):
        self.start(G * T)
        ref_params = make_params()
        want = run(ReferenceMuon(groups(ref_params), **HYPER), ref_params)
        params = make_params()
        opt = Muon(groups(params), daemons=self.addresses, job_id="fake", gtp_size=G, tp_size=T,
                   **HYPER)
        try:
            got = run(opt, params)
            self.assertEqual(opt.step_id, 3)
            self.assertEqual(opt.last_timings["total_us"], 100.0 * G * T)  # max over daemons
            self.assertGreaterEqual(opt.last_timings["rpc_us"], 0)
        finally:
            opt.close()
        for name in PARAMS:
            # Same formulas on the same full matrices: bitwise equal is expected.
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
            self.assertFalse(torch.equal(got[name], make_params()[name]), name)
        return opt

    def test_2x2_matches_reference(self):
        opt = self.compare(2, 2)
        lay = opt.layouts
        self.assertEqual((lay["w_pad_tp1"].tp_dim, lay["w_pad_tp1"].pad_length), (1, 1))
        self.assertEqual(lay["w_tp0"].tp_dim, 0)
        self.assertEqual(lay["w_fallback"].tp_dim, 1)
        self.assertEqual(lay["w_solo"][0], "solo")
        # Wire conventions every daemon received.
        for rank, d in enumerate(self.cluster.daemons):
            req = d.requests[0]
            self.assertEqual(req.job_id, "fake")
            dense = [g for g in req.groups if g.domain.name == "dense"]
            self.assertEqual(len(dense), 1)
            self.assertEqual((dense[0].domain.g, dense[0].domain.t), divmod(rank, 2))
            self.assertEqual(dense[0].muon.extra_scale_factor, 0.2)
            for g in req.groups:
                if g.domain.name != "dense":
                    self.assertEqual(g.domain.name, f"solo-r{rank}")
                    # One wire group name per domain: the coordinator checks it.
                    self.assertTrue(g.name.endswith(f".solo-r{rank}"), g.name)
                    self.assertEqual((g.domain.gtp_size, g.domain.tp_size), (1, 1))
        # Every param is registered exactly once per shard: no double updates.
        owners = {}
        for d in self.cluster.daemons:
            for g in d.requests[0].groups:
                for p in g.params:
                    owners.setdefault(p.name, []).append(d.rank)
        for name, ranks in owners.items():
            split = name in ("w_pad_tp1", "w_tp0", "w_fallback", "w_tall")
            self.assertEqual(sorted(ranks), [0, 1, 2, 3] if split else ranks, name)
            self.assertEqual(len(ranks), 4 if split else 1, name)

    def test_engine_error_fails_the_constructor_at_once(self):
        self.start(2)
        self.cluster.daemons[1].engine_error = "DEADLINE_EXCEEDED: rendezvous: rank 0 never came"
        t0 = time.monotonic()
        with self.assertRaisesRegex(RuntimeError, r"no step engine: DEADLINE_EXCEEDED: "
                                                  r"rendezvous: rank 0 never came"):
            Muon(groups(make_params()), daemons=self.addresses, job_id="fake", gtp_size=2,
                 tp_size=1, wait_healthy_timeout=60, **HYPER)
        self.assertLess(time.monotonic() - t0, 20, "it waited out wait_healthy_timeout")
        # The failed constructor unregistered everywhere.
        self.assertEqual([d.groups for d in self.cluster.daemons], [[], []])

    def test_no_plan_timeout_says_every_rank_must_register(self):
        # One process with RANK=0 of a 3-daemon job: its daemon serves, the
        # plan never comes (ranks 1 and 2 never register).
        self.start(3)
        self.cluster.daemons[0].plan_ready = False
        env = {"RANK": "0", "WORLD_SIZE": "3", "MUOND_DAEMON": self.addresses[0]}
        with mock.patch.dict(os.environ, env):
            with self.assertRaisesRegex(TimeoutError, r"no plan yet\); the plan waits for every "
                                        r"rank's trainer .*torchrun job must run all "
                                        r"\$WORLD_SIZE=3 ranks"):
                Muon(groups(make_params()), job_id="fake", wait_healthy_timeout=0.5, **HYPER)

    def test_missing_default_socket_fails_at_once(self):
        self.start(1)  # unused: tearDown stops it
        env = {"RANK": "0", "XDG_RUNTIME_DIR": self.dir}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("MUOND_JOB_ID", None)
            os.environ.pop("MUOND_DAEMON", None)
            t0 = time.monotonic()
            with self.assertRaisesRegex(FileNotFoundError,
                                        rf"no daemon socket at {self.dir}/muond/muond-default-0"
                                        r"\.sock.*job 'default' \(\$MUOND_JOB_ID is unset"):
                Muon(groups(make_params()), wait_healthy_timeout=60, **HYPER)
            self.assertLess(time.monotonic() - t0, 10, "it waited out wait_healthy_timeout")
            # A socket path that exists (a daemon still starting) is waited for.
            os.makedirs(f"{self.dir}/muond")
            open(f"{self.dir}/muond/muond-default-0.sock", "w").close()
            t0 = time.monotonic()
            with self.assertRaisesRegex(TimeoutError, "not healthy after"):
                Muon(groups(make_params()), wait_healthy_timeout=1.0, **HYPER)
            self.assertGreaterEqual(time.monotonic() - t0, 1.0)

    def test_a_failing_daemon_fails_the_step_while_a_peer_never_answers(self):
        self.start(2)
        params = make_params()
        opt = Muon(groups(params), daemons=self.addresses, job_id="fake", gtp_size=2,
                   tp_size=1, **HYPER)
        stuck = threading.Event()
        self.addCleanup(stuck.set)

        def never_answers(request, context):
            stuck.wait(60)  # a stopped daemon
            context.abort(grpc.StatusCode.CANCELLED, "released")

        def fails(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "a peer daemon is gone")

        self.cluster.daemons[0].on_step = never_answers
        self.cluster.daemons[1].on_step = fails
        for p in params.values():
            p.grad = torch.ones_like(p)
        t0 = time.monotonic()
        with self.assertRaisesRegex(RuntimeError, r"Step 1 failed: UNAVAILABLE: a peer daemon "
                                                  r"is gone"):
            opt.step()
        self.assertLess(time.monotonic() - t0, 20, "step() waited for the stopped daemon")
        self.assertEqual(opt.step_id, 0)  # not advanced: the step can be retried

    def test_the_daemons_reason_reaches_the_caller_typed(self):
        self.start(2)
        params = make_params()
        opt = Muon(groups(params), daemons=self.addresses, job_id="fake", gtp_size=2,
                   tp_size=1, **HYPER)

        def peer_gone(request, context):
            # What the real daemon sends (proto/status_details.cc).
            info = error_details_pb2.ErrorInfo(reason="PEER_GONE", domain="muond.dev",
                                               metadata={"step_id": str(request.step_id)})
            status = error_details_pb2.RpcStatus(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                                 message="a peer daemon is gone")
            status.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo",
                               value=info.SerializeToString())
            context.set_trailing_metadata(
                (("grpc-status-details-bin", status.SerializeToString()),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "a peer daemon is gone")

        for d in self.cluster.daemons:
            d.on_step = peer_gone
        for p in params.values():
            p.grad = torch.ones_like(p)
        with self.assertRaises(MuondError) as raised:
            opt.step()
        self.assertIsInstance(raised.exception, RuntimeError)
        self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(raised.exception.reason, PEER_GONE)
        self.assertEqual(raised.exception.metadata, {"step_id": "1"})
        self.assertIn("Step 1 failed: UNAVAILABLE: a peer daemon is gone",
                      str(raised.exception))

    def test_an_unreachable_daemon_is_peer_gone(self):
        # A daemon whose process is gone answers nothing: the trainer gets the
        # same reason as from a surviving peer's PEER_GONE, naming the daemon.
        self.start(2)
        params = make_params()
        opt = Muon(groups(params), daemons=self.addresses, job_id="fake", gtp_size=2,
                   tp_size=1, **HYPER)
        self.cluster.daemons[1].stop()
        for p in params.values():
            p.grad = torch.ones_like(p)
        with self.assertRaises(MuondError) as raised:
            opt.step()
        self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(raised.exception.reason, PEER_GONE)
        self.assertEqual(raised.exception.metadata, {"daemon": self.addresses[1]})

    def test_4x1_matches_reference(self):
        self.compare(4, 1)

    def test_1x3_matches_reference(self):
        self.compare(1, 3)

    def test_single_daemon_matches_reference(self):
        self.compare(1, 1)


def run_replacing_grads(opt, params, steps=4):
    """Like run(), but on odd steps every grad is a *new* tensor assigned to
    ``p.grad`` (as user code may do) instead of accumulated in place."""
    g = torch.Generator().manual_seed(23)
    for step in range(steps):
        if step % 2:
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g)
        else:
            opt.zero_grad(set_to_none=False)
            for p in params.values():
                (p * torch.randn(p.shape, generator=g)).sum().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


class ReplacedGradTest(unittest.TestCase):
    """step() copies a grad tensor that replaced the shared one (the daemon
    reads only the shared buffer) and re-points .grad, so the next backward
    accumulates into the shared buffer again."""

    def test_replaced_grads_are_used(self):
        d = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        cluster, addresses = start_cluster(d, 2)
        try:
            ref_params = make_params()
            want = run_replacing_grads(ReferenceMuon(groups(ref_params), **HYPER), ref_params)
            params = make_params()
            opt = Muon(groups(params), daemons=addresses, job_id="replace", gtp_size=2,
                       tp_size=1, **HYPER)
            shared = {id(p): grad for p, grad in opt._grads}
            try:
                got = run_replacing_grads(opt, params)
                for name, p in params.items():  # re-pointed to the shared buffer
                    self.assertIs(p.grad, shared[id(p)], name)
            finally:
                opt.close()
            for name in PARAMS:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
        finally:
            for daemon in cluster.daemons:
                daemon.stop()


class LocalModeTest(unittest.TestCase):
    def test_local_mode_registers_tags(self):
        d = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        cluster, addresses = start_cluster(d, 1)
        try:
            w = torch.nn.Parameter(torch.randn(5, 4))  # rank's shard of a (9*2, 4)... tagged
            w.tensor_model_parallel, w.partition_dim = True, 1
            w.is_gtp_weight_remat, w.pad_length = True, 1
            opt = Muon([w], daemons=addresses, shard_mode="local", gtp_size=2, tp_size=2,
                       g=1, t=0, job_id="loc")
            p = cluster.daemons[0].requests[0].groups[0].params[0]
            self.assertEqual(list(p.full_shape), [9, 8])
            self.assertEqual((p.tags.partition_dim, p.tags.pad_length), (1, 1))
            g = cluster.daemons[0].requests[0].groups[0].domain
            self.assertEqual((g.name, g.gtp_size, g.tp_size, g.g, g.t), ("dense", 2, 2, 1, 0))
            regions = {r.name: r for r in cluster.daemons[0].requests[0].regions}
            self.assertEqual(regions[p.param.region].kind, pb.MEMORY_KIND_HOST_SHM)
            self.assertEqual(list(p.param.strides), [4, 1])
            opt.close()
        finally:
            cluster.daemons[0].stop()


class OptimizerProtocolTest(unittest.TestCase):
    def test_state_dict_carries_the_step_id_and_no_late_groups(self):
        d = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        cluster, addresses = start_cluster(d, 1)
        try:
            w = torch.nn.Parameter(torch.randn(6, 4))
            opt = Muon([w], daemons=addresses, job_id="proto")
            self.assertEqual(opt.param_groups[0]["coefficient_type"], "simple")  # torch's
            for _ in range(2):
                w.grad = torch.randn(6, 4)
                opt.step()
            sd = opt.state_dict()
            self.assertEqual(sd["muond_step_id"], 2)
            opt.step_id = 0
            opt.load_state_dict(sd)
            self.assertEqual(opt.step_id, 2)
            # add_param_group after construction works; the step id stays.
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))]})
            self.assertEqual(opt.step_id, 2)
            opt.close()
        finally:
            cluster.daemons[0].stop()


if __name__ == "__main__":
    unittest.main()
