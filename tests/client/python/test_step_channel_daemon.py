"""muond.torch.Muon through a real host daemon's step channel (a coordinator
and one `muond-daemon --host`, contract/cluster.py). Steps through the
channel give the params the same steps give over the Step RPC, bitwise; a
refused step raises the same MuondError over both and changes nothing; a
daemon killed while the trainer waits for its answer is PEER_GONE, not a
hang; a request or an answer too large for the channel goes over gRPC; a
daemon out of channels leaves the trainer on gRPC; no shm name is left
behind. Which way each step went is counted at the client's gRPC stub."""
import glob
import os
import re
import signal
import sys
import time
import unittest
import uuid

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract"))
from cluster import Cluster, ClusterTestCase, find_binaries, wait_for  # noqa: E402
from muond import _rules  # noqa: E402
from muond.client import PEER_GONE, MuondError  # noqa: E402
from muond.torch import Muon  # noqa: E402

STEPS = 3
MIN_CAPACITY = _rules.STEP_CHANNEL_MIN_CAPACITY


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def train(opt, model, steps=STEPS):
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()


def count_grpc_steps(client) -> list:
    """The step ids ``client`` sends with the Step RPC from now on."""
    sent, rpc = [], client.stub.Step

    def counted(request, **kw):
        sent.append(request.step_id)
        return rpc(request, **kw)

    counted.future = rpc.future  # a trainer refusal's call
    client.stub.Step = counted
    return sent


def shm_names(job: str) -> list:
    return glob.glob(f"/dev/shm/muond-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-*")


class ChannelStepsTest(ClusterTestCase):
    def muon(self, model, **kw):
        opt = Muon(model.named_parameters(), lr=0.02, daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, rpc_timeout=60, **kw)
        self.addCleanup(opt.close)
        return opt

    def test_steps_through_the_channel_equal_steps_over_grpc(self):
        params, grpc_steps = {}, {}
        for step_channel in (True, False):
            model = make_model()
            opt = self.muon(model, step_channel=step_channel)
            self.assertEqual(opt.clients[0].has_step_channel, step_channel)
            self.assertEqual(opt.uses_step_channel, step_channel)
            grpc_steps[step_channel] = count_grpc_steps(opt.clients[0])
            train(opt, model)
            self.assertGreater(opt.last_timings["total_us"], 0)
            # The legs, on the clock both processes read: never negative,
            # never past the step's whole round trip (another clock, or the
            # stamps swapped, would be off by far more).
            legs = [opt.last_timings.get(k) for k in ("request_leg_us", "answer_leg_us")]
            if step_channel:
                for leg in legs:
                    self.assertGreaterEqual(leg, 0)
                    self.assertLess(leg, opt.last_timings["rpc_us"])
            else:
                self.assertEqual(legs, [None, None])
            params[step_channel] = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.close()
        self.assertEqual(grpc_steps, {True: [], False: list(range(1, STEPS + 1))})
        for name, want in params[False].items():
            self.assertTrue(torch.equal(params[True][name], want), name)

    def test_a_refused_step_raises_as_over_grpc_and_changes_nothing(self):
        errors = []
        for step_channel in (True, False):
            model = make_model()
            opt = self.muon(model, step_channel=step_channel)
            sent = count_grpc_steps(opt.clients[0])
            train(opt, model, steps=1)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            model[0].weight.grad[1, 2] = float("nan")
            with self.assertRaises(MuondError) as raised:
                opt.step()
            e = raised.exception
            errors.append((str(e), e.code, e.reason, e.metadata))
            self.assertEqual(opt.step_id, 1)
            for name, p in model.named_parameters():
                self.assertTrue(torch.equal(p, before[name]), name)
            model[0].weight.grad[1, 2] = 0.0
            opt.step()  # the same step id again, now applied
            self.assertEqual(opt.step_id, 2)
            self.assertEqual(sent, [] if step_channel else [1, 2, 2])
            self.assertEqual(opt.clients[0].has_step_channel, step_channel)
            opt.close()
        self.assertEqual(errors[0], errors[1])
        self.assertIn("0.weight", errors[0][0])


class LargeStepsTest(ClusterTestCase):
    """Names long enough that a step's skip_params (every grad None) and its
    skipped_nonfinite (every grad NaN; the daemon skips such a step) pass
    64 KiB, the channel's smallest area."""

    EXTRA_DAEMON_ARGS = ("--skip_nonfinite",)

    def setUp(self):
        self.params = {f"p{i:03d}-" + "x" * 900: torch.nn.Parameter(torch.randn(4, 4))
                       for i in range(100)}
        self.opt = Muon(list(self.params.items()), lr=0.02, daemons=self.cluster.daemons,
                        job_id=self.cluster.job_id, rpc_timeout=60)
        self.addCleanup(self.opt.close)
        self.client = self.opt.clients[0]
        self.sent = count_grpc_steps(self.client)

    def test_the_optimizers_channel_carries_them(self):
        for p in self.params.values():
            p.grad = torch.full_like(p, float("nan"))
        self.opt.step()
        self.assertEqual(len(self.opt.last_responses[0].skipped_nonfinite), 100)
        self.opt.zero_grad()
        self.opt.step()
        self.assertEqual(self.sent, [])

    def test_with_a_small_channel_they_go_over_grpc(self):
        self.assertTrue(self.client.open_step_channel(self.opt.job_id, MIN_CAPACITY,
                                                      MIN_CAPACITY))
        before = {n: p.detach().clone() for n, p in self.params.items()}
        self.opt.zero_grad()
        self.opt.step()  # skip_params of every name: not sent through the channel
        self.assertEqual(self.sent, [1])
        for p in self.params.values():
            p.grad = torch.full_like(p, float("nan"))
        self.opt.step()  # its answer does not fit: the same step fetched over gRPC
        self.assertEqual(self.sent, [1, 2])
        self.assertEqual(self.opt.step_id, 2)  # the resend's answer is this step's
        self.assertFalse(self.opt.last_responses[0].replayed)  # the record of our own
        self.assertEqual(len(self.opt.last_responses[0].skipped_nonfinite), 100)
        self.assertTrue(self.client.has_step_channel)
        for name, p in self.params.items():
            self.assertTrue(torch.equal(p, before[name]), name)


class FullDaemonTest(ClusterTestCase):
    """A daemon with room for one channel."""

    EXTRA_DAEMON_ARGS = ("--max_step_channels=1",)

    def test_a_refused_open_leaves_the_trainer_on_grpc_and_no_shm_name(self):
        job = f"chan{os.getpid()}-{uuid.uuid4().hex[:6]}"
        holder = self.cluster.client(self.cluster.daemons[0])
        self.addCleanup(holder.close)
        self.assertTrue(holder.open_step_channel(job, MIN_CAPACITY, MIN_CAPACITY))
        self.assertEqual(shm_names(job), [])  # unlinked once the daemon has it
        other = self.cluster.client(self.cluster.daemons[0])
        self.addCleanup(other.close)
        self.assertFalse(other.open_step_channel(job, MIN_CAPACITY, MIN_CAPACITY))
        self.assertEqual(shm_names(job), [])  # unlinked after a refusal too
        model = make_model()
        opt = Muon(model.named_parameters(), lr=0.02, daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, rpc_timeout=60)
        self.addCleanup(opt.close)
        self.assertFalse(opt.clients[0].has_step_channel)
        sent = count_grpc_steps(opt.clients[0])
        train(opt, model, steps=2)
        self.assertEqual(sent, [1, 2])


class DaemonKilledTest(unittest.TestCase):
    """SIGKILL of the daemon while the trainer waits in step() for the
    channel's answer: the daemon is stopped first (SIGSTOP), so the request
    is posted and unanswered when it dies. The deadline is far away, so only
    the daemon's released lock can end the wait."""

    def setUp(self):
        find_binaries(self)
        self.cluster = Cluster(1).start()
        self.addCleanup(self.cluster.stop)

    def test_a_killed_daemon_is_peer_gone_not_a_hang(self):
        model = make_model()
        opt = Muon(model.named_parameters(), lr=0.02, daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, rpc_timeout=600)
        self.addCleanup(opt.close)
        train(opt, model, steps=1)
        daemon = self.cluster.process("muond-rank0")
        channel = opt.clients[0]._step_channel
        wait = channel._await_answer

        def kill_then_wait(timeout):  # the request is posted: the daemon dies
            daemon.send_signal(signal.SIGKILL)
            return wait(timeout)

        daemon.send_signal(signal.SIGSTOP)
        wait_for(lambda: _stopped(daemon.pid), 20, "the daemon stopped")
        channel._await_answer = kill_then_wait
        opt.zero_grad()
        model(torch.randn(5, 6)).pow(2).mean().backward()
        t0 = time.monotonic()
        with self.assertRaises(MuondError) as raised:
            opt.step()
        waited = time.monotonic() - t0
        self.assertEqual((raised.exception.code.name, raised.exception.reason),
                         ("UNAVAILABLE", PEER_GONE), str(raised.exception))
        self.assertEqual(raised.exception.metadata, {"daemon": self.cluster.daemons[0]})
        self.assertEqual(opt.step_id, 1)
        self.assertFalse(opt.clients[0].has_step_channel)  # broken: gRPC from now on
        print(f"PEER_GONE {waited:.2f} s after the daemon's SIGKILL", file=sys.stderr)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


if __name__ == "__main__":
    unittest.main()
