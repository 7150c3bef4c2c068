"""muond.torch.Muon's steps through a step channel (``step_channel=True``,
the default) on a fake daemon that offers one: fake_daemon.FakeDaemon's Step
answering through step_channel_double's double. The params, a refusal and
last_timings are what the same steps give over gRPC; the channel is sized
for the registration, opened again after add_param_group and closed with
the optimizer; two daemons, ``step_channel=False`` and a trainer's own
refusal stay on gRPC."""
import os
import shutil
import sys
import tempfile
import unittest
from unittest import mock

import grpc
import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import FakeCluster, FakeDaemon, pb  # noqa: E402
from step_channel_double import HAVE_CHANNELS, ChannelDouble, servicer_answers  # noqa: E402
from test_muon_fake_daemon import HYPER, groups, make_params, run  # noqa: E402
from muond import _rules  # noqa: E402
from muond.client import MuondError  # noqa: E402
from muond.step_channel import capacities  # noqa: E402
from muond.torch import Muon  # noqa: E402
from muond.torch.memory import SharedParams  # noqa: E402
from muond.v1 import error_details_pb2  # noqa: E402

_REFUSAL_BYTES = 4096 * 4  # muond.torch.optimizer's _MAX_REFUSAL_CHARS, 4 bytes each


class ChannelFakeDaemon(FakeDaemon):
    """A fake daemon that opens step channels, answering them with its Step."""

    def __init__(self, *args):
        self.doubles = []
        super().__init__(*args)

    def OpenStepChannel(self, request, context):
        self.doubles.append(ChannelDouble(request.shm_name, servicer_answers(self)))
        return pb.OpenStepChannelResponse(version=_rules.STEP_CHANNEL_VERSION)


def refuse_nonfinite(request, context):
    """A daemon's refusal as the real one sends it (proto/status_details.cc)."""
    info = error_details_pb2.ErrorInfo(reason="REFUSED_BY_PEER", domain="muond.dev",
                                       metadata={"ranks": "0"})
    message = f"step {request.step_id}: param 'w_tall' has a non-finite gradient"
    status = error_details_pb2.RpcStatus(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                         message=message)
    status.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo",
                       value=info.SerializeToString())
    context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


@unittest.skipUnless(HAVE_CHANNELS, "Linux only")
class MuonStepChannelTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def start(self, world=1, daemon_class=ChannelFakeDaemon):
        """Fake daemons of a fresh cluster; their addresses."""
        cluster = FakeCluster(world)
        run_dir = tempfile.mkdtemp(dir=self.dir)
        addresses = [f"unix://{run_dir}/fake-{r}.sock" for r in range(world)]
        for r, a in enumerate(addresses):
            daemon_class(cluster, r, a)
        self.addCleanup(lambda: [(d.stop(), [c.stop() for c in getattr(d, "doubles", [])])
                                 for d in cluster.daemons])
        self.daemons = cluster.daemons
        return addresses

    def muon(self, params, addresses, **kw):
        opt = Muon(groups(params), daemons=addresses, job_id="chan", gtp_size=len(addresses),
                   tp_size=1, **HYPER, **kw)
        self.addCleanup(opt.close)
        return opt

    def test_steps_through_the_channel_equal_steps_over_grpc(self):
        params = make_params()
        opt = self.muon(params, self.start())
        got = run(opt, params)
        daemon = self.daemons[0]
        [double] = daemon.doubles
        self.assertEqual([r.step_id for r in double.requests], [1, 2, 3])
        self.assertEqual(len(daemon.step_requests), 3)  # none over gRPC
        self.assertGreater(opt.last_timings["rpc_us"], 0)
        plain = make_params()
        want = run(self.muon(plain, self.start(), step_channel=False), plain)
        self.assertEqual(self.daemons[0].doubles, [])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    def test_the_channel_is_sized_for_the_registration_and_closed_with_it(self):
        params = make_params()
        opt = self.muon(params, self.start())
        daemon = self.daemons[0]
        [double] = daemon.doubles
        self.assertEqual((double.request_capacity, double.response_capacity),
                         capacities(daemon.requests[-1].groups, _REFUSAL_BYTES))
        opt.close()
        double.thread.join(5)
        self.assertEqual(double.ops, [_rules.STEP_CHANNEL_OP_CLOSE])
        self.assertFalse(double.trainer_lock_held())

    def test_add_param_group_opens_a_channel_for_the_new_registration(self):
        params = make_params()
        opt = self.muon(params, self.start())
        daemon = self.daemons[0]
        extra = torch.nn.Parameter(torch.randn(5, 3))
        opt.add_param_group({"params": [extra], "param_names": ["w_extra_" + "x" * 5000]})
        first, second = daemon.doubles
        first.thread.join(5)
        self.assertEqual(first.ops, [_rules.STEP_CHANNEL_OP_CLOSE])
        self.assertEqual((second.request_capacity, second.response_capacity),
                         capacities(daemon.requests[-1].groups, _REFUSAL_BYTES))
        self.assertGreater(second.response_capacity, first.response_capacity)
        run(opt, params, steps=1)
        self.assertEqual([r.step_id for r in second.requests], [1])

    def test_a_refused_step_raises_as_over_grpc_and_changes_nothing(self):
        errors, opts = [], []
        for step_channel in (True, False):
            params = make_params()
            opt = self.muon(params, self.start(), step_channel=step_channel)
            opts.append(opt)
            self.daemons[0].on_step = refuse_nonfinite
            for p in params.values():
                p.grad = torch.ones_like(p)
            before = {n: p.detach().clone() for n, p in params.items()}
            with self.assertRaises(MuondError) as raised:
                opt.step()
            e = raised.exception  # each run has its own daemon address
            errors.append((str(e).replace(opt.clients[0].address, "<daemon>"), e.code,
                           e.reason, e.metadata))
            self.assertEqual(opt.step_id, 0)
            through = [r.step_id for d in self.daemons[0].doubles for r in d.requests]
            self.assertEqual(through, [1] if step_channel else [])
            for name, p in params.items():
                self.assertTrue(torch.equal(p, before[name]), name)
        self.assertEqual(errors[0], errors[1])
        self.assertIn("param 'w_tall'", errors[0][0])
        self.assertEqual(errors[0][2], "REFUSED_BY_PEER")
        self.assertTrue(opts[0].clients[0].has_step_channel)  # answered: kept

    def test_a_trainer_refusal_goes_over_grpc(self):
        params = make_params()
        opt = self.muon(params, self.start())
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.param_groups[0]["ns_steps"] = 7  # a fixed entry: refused before sending
        with self.assertRaisesRegex(ValueError, "ns_steps"):
            opt.step()
        daemon = self.daemons[0]
        self.assertEqual(daemon.doubles[0].requests, [])
        self.assertIn("ns_steps", daemon.step_requests[-1].trainer_refusal)
        self.assertTrue(opt.clients[0].has_step_channel)

    def test_two_daemons_or_the_option_off_open_no_channel(self):
        for world, kw in ((2, {}), (1, {"step_channel": False})):
            with self.subTest(world=world, **kw):
                params = make_params()
                opt = self.muon(params, self.start(world), **kw)
                run(opt, params, steps=1)
                self.assertEqual([d.doubles for d in self.daemons], [[]] * world)
                self.assertFalse(any(c.has_step_channel for c in opt.clients))

    def test_a_daemon_without_channels_steps_over_grpc(self):
        params = make_params()
        opt = self.muon(params, self.start(daemon_class=FakeDaemon))
        run(opt, params, steps=2)
        self.assertFalse(opt.clients[0].has_step_channel)
        self.assertEqual([r.step_id for r in self.daemons[0].step_requests], [1, 2])

    def test_the_answer_is_polled_for_only_while_a_gpu_runs_the_step(self):
        for on_cuda, want in ((False, 0.0), (True, 0.004)):
            with self.subTest(on_cuda=on_cuda):
                params, addresses = make_params(), self.start()
                # Registration reads where the grads live (CPU here).
                with mock.patch.object(SharedParams, "any_cuda", return_value=on_cuda):
                    opt = self.muon(params, addresses, step_channel_poll_ms=4)
                    opt._ensure_registered()
                self.assertEqual(opt.clients[0]._step_channel._poll_s, want)
        params = make_params()
        opt = self.muon(params, self.start())
        run(opt, params, steps=1)
        self.assertEqual(opt.clients[0]._step_channel._poll_s, 0.0)  # the default
        # numpy's scalars and one-element tensors are numbers too; 100 ms is
        # the longest poll.
        for ms, want in ((numpy.float32(2.5), 0.0025), (numpy.int64(2), 0.002),
                         (torch.tensor(2.0), 0.002), (100, 0.1)):
            params, addresses = make_params(), self.start()
            with mock.patch.object(SharedParams, "any_cuda", return_value=True):
                opt = self.muon(params, addresses, step_channel_poll_ms=ms)
                opt._ensure_registered()
            self.assertAlmostEqual(opt.clients[0]._step_channel._poll_s, want)

    def test_step_channel_poll_ms_must_be_a_number_in_range(self):
        for bad in (-1, 101, float("nan"), float("inf"), True, numpy.bool_(True),
                    torch.tensor(True), torch.ones(2), "1", None, 10 ** 400):
            with self.subTest(bad=bad), self.assertRaisesRegex(
                    ValueError, "step_channel_poll_ms must be a number of ms in \\[0, 100\\]"):
                Muon(groups(make_params()), daemons=["unix:///nonexistent.sock"],
                     job_id="chan", step_channel_poll_ms=bad)

    def test_step_channel_must_be_a_bool(self):
        with self.assertRaisesRegex(ValueError, "step_channel must be a bool, got 'yes'"):
            Muon(groups(make_params()), daemons=["unix:///nonexistent.sock"], job_id="chan",
                 step_channel="yes")


class TripLegsTest(unittest.TestCase):
    """last_timings' request_leg_us / answer_leg_us from the trainer's clock
    readings (Client.last_trip) and the daemon's stamps: there on one clock,
    absent over gRPC, with two daemons, unstamped, or off the clock."""

    def legs(self, trip, received, answered, rpc_us=4000.0, clients=1):
        from muond.torch.optimizer import _trip_legs
        r = pb.StepResponse()
        r.timings.received_at_us, r.timings.answered_at_us = received, answered
        client = mock.Mock(last_trip=trip)
        return _trip_legs([client] * clients, [r] * clients, rpc_us)

    def test_legs_on_one_clock(self):
        legs = self.legs((10.0, 10.004), 10_000_150, 10_003_920)
        self.assertAlmostEqual(legs["request_leg_us"], 150, places=3)
        self.assertAlmostEqual(legs["answer_leg_us"], 80, places=3)

    def test_no_legs_where_they_cannot_be_read(self):
        self.assertEqual(self.legs(None, 10_000_150, 10_003_920), {})  # the Step RPC
        self.assertEqual(self.legs((10.0, 10.004), 0, 0), {})  # unstamped
        self.assertEqual(self.legs((10.0, 10.004), 10_000_150, 10_003_920, clients=2), {})
        # Another clock: the daemon's stamps before the request or past the answer.
        self.assertEqual(self.legs((10.0, 10.004), 9_000_000, 9_000_100), {})
        self.assertEqual(self.legs((10.0, 10.004), 90_000_000, 90_000_100), {})


if __name__ == "__main__":
    unittest.main()
