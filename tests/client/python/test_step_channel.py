"""muond.step_channel (the trainer's end) and Client.step through it,
against a daemon-side double of the channel (step_channel_double.py) served
by an in-process gRPC daemon whose Step RPC answers what was not sent
through the channel, so each test sees which way a step went. A failure
through the channel is compared with the same status raised by a real gRPC
call."""
import glob
import os
import signal
import sys
import tempfile
import threading
import time
import unittest
import uuid
from concurrent import futures

import muond  # noqa: F401  (before grpc: gRPC's fork handlers off, for the fork test)
import grpc  # noqa: E402

from muond import _rules
from muond import shm as muond_shm
from muond.client import Client, MuondError, error_info, error_reason
from muond.step_channel import (SHM_DIR, ChannelAnswerTooLarge, ChannelRpcError,
                                ChannelUnusable, StepChannel, capacities, shm_name)
from muond.torch import rpc as torch_rpc
from muond.v1 import error_details_pb2
from muond.v1 import muond_pb2 as pb
from muond.v1 import muond_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_channel_double import (DETAILS_KEY, HAVE_CHANNELS, RPC_STATUS,  # noqa: E402
                                 STEP_RESPONSE, TOO_LARGE, ChannelDouble)

CAP = _rules.STEP_CHANNEL_MIN_CAPACITY  # each area's smallest size


def applied(request) -> tuple:
    return STEP_RESPONSE, pb.StepResponse(step_id=request.step_id, plan_version=7,
                                          skipped_nonfinite=["w"]).SerializeToString()


def refusal_status() -> bytes:
    """A refusal as the daemon's codec writes it: RpcStatus with one muond
    ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason="REFUSED_BY_PEER", domain=_rules.ERROR_DOMAIN,
                                       metadata={"ranks": "1"})
    status = error_details_pb2.RpcStatus(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        message="step 3: param 'w' has non-finite gradients")
    detail = status.details.add()
    detail.type_url = "type.googleapis.com/google.rpc.ErrorInfo"
    detail.value = info.SerializeToString()
    return status.SerializeToString()


class DoubleDaemon(pb_grpc.OptimizerServicer):
    """OpenStepChannel makes a ChannelDouble (or refuses: ``refuse`` a
    grpc.StatusCode); Step answers over gRPC with ``grpc_answer``."""

    def __init__(self):
        self.answer = applied
        self.grpc_answer = lambda request, context: pb.StepResponse(step_id=request.step_id)
        self.refuse, self.version = None, _rules.STEP_CHANNEL_VERSION
        self.answers_kept = False
        self.doubles, self.grpc_requests = [], []

    def OpenStepChannel(self, request, context):
        if self.refuse is not None:
            context.abort(self.refuse, "refused by the test")
        self.doubles.append(ChannelDouble(request.shm_name, lambda r: self.answer(r)))
        return pb.OpenStepChannelResponse(version=self.version,
                                          answers_kept=self.answers_kept)

    def Step(self, request, context):
        self.grpc_requests.append(request)
        return self.grpc_answer(request, context)


class PlainDaemon(pb_grpc.OptimizerServicer):
    """A daemon without OpenStepChannel (UNIMPLEMENTED), as the fake daemon."""

    def Step(self, request, context):
        return pb.StepResponse(step_id=request.step_id)


class ChannelTestCase(unittest.TestCase):
    SERVICER = DoubleDaemon

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="muond-chan-")
        self.addCleanup(self.tmp.cleanup)
        self.daemon = self.SERVICER()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_OptimizerServicer_to_server(self.daemon, self.server)
        self.address = f"unix://{self.tmp.name}/d.sock"
        self.server.add_insecure_port(self.address)
        self.server.start()
        self.addCleanup(self.server.stop, None)
        self.addCleanup(lambda: [d.stop() for d in getattr(self.daemon, "doubles", [])])
        self.job = f"chantest{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.client = self.new_client()

    def new_client(self, timeout=10):
        client = Client(self.address, timeout=timeout)
        self.addCleanup(client.close)
        return client

    def shm_left(self) -> list:
        return glob.glob(f"/dev/shm/muond-{self.job}-*")

    def open(self, client=None, request_capacity=CAP, response_capacity=CAP):
        return StepChannel.open(client or self.client, self.job, request_capacity,
                                response_capacity)

    def step(self, client=None, step_id=1, **kw):
        return (client or self.client).step(self.job, step_id, **kw)


@unittest.skipUnless(HAVE_CHANNELS, "Linux only")
class OpenTest(ChannelTestCase):
    def test_open_writes_the_header_takes_the_lock_and_unlinks_the_name(self):
        channel = self.open(request_capacity=CAP + 4096, response_capacity=CAP + 8192)
        self.addCleanup(channel.close)
        double = self.daemon.doubles[0]
        self.assertEqual((double.magic, double.version), (_rules.STEP_CHANNEL_MAGIC,
                                                          _rules.STEP_CHANNEL_VERSION))
        self.assertEqual((double.request_capacity, double.response_capacity),
                         (CAP + 4096, CAP + 8192))
        self.assertEqual(os.fstat(double.fd).st_size, 4096 + 2 * CAP + 12288)
        self.assertEqual(os.fstat(double.fd).st_mode & 0o777, 0o600)
        self.assertTrue(double.trainer_lock_held())
        self.assertEqual(self.shm_left(), [])

    def test_refusals_and_other_versions_give_none_and_leave_no_name(self):
        for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
            with self.subTest(code=code):
                self.daemon.refuse = code
                self.assertIsNone(self.open())
                self.assertEqual(self.shm_left(), [])
        self.daemon.refuse, self.daemon.version = None, _rules.STEP_CHANNEL_VERSION + 1
        self.assertIsNone(self.open())
        self.assertEqual(self.shm_left(), [])
        # The double it made sees the trainer's lock go: no close op needed.
        self.assertFalse(self.daemon.doubles[0].trainer_lock_held())

    def test_names_cannot_be_guessed_by_another_process(self):
        # Another local user sees the names in /dev/shm: were the next one
        # predictable (a counter), creating it first would turn the channel
        # off (O_EXCL). Its last field is 63 random bits.
        names = [muond_shm.shm_name(self.job) for _ in range(200)]
        lasts = [int(n.rsplit("-", 1)[1]) for n in names]
        self.assertEqual(len(set(lasts)), len(lasts))
        self.assertGreater(max(lasts), 1 << 40)
        self.assertFalse(any(b - a == 1 for a, b in zip(lasts, lasts[1:])))
        for n in names:
            self.assertEqual(muond_shm.parse_shm_name(n), (self.job, os.getpid()))

    def test_capacities_are_whole_pages_within_the_bounds(self):
        for bad in (0, CAP - 4096, CAP + 1, _rules.STEP_CHANNEL_MAX_CAPACITY + 4096):
            with self.subTest(capacity=bad), self.assertRaisesRegex(
                    ValueError, "request_capacity .* multiple of 4096"):
                self.open(request_capacity=bad)
        self.assertEqual(self.daemon.doubles, [])

    def test_capacities_of_a_registration(self):
        groups = [pb.ParamGroup(name="g", params=[pb.Param(name="é" * 40000)])]
        request, response = capacities(groups, 16384)
        names = 80000 + 16
        prefix = len("g/")  # an answer names a skipped param "group/param"
        self.assertEqual(response, -(-((64 << 10) + names + prefix) // 4096) * 4096)
        self.assertEqual(request, -(-((64 << 10) + names + 1 + 64 + 16384) // 4096) * 4096)
        long_group = [pb.ParamGroup(name="G" * 4000, params=[pb.Param(name="p")] * 10)]
        self.assertEqual(capacities(long_group, 0)[1], 26 * 4096)  # 65536 + 170 + 40010
        huge = [pb.ParamGroup(name="g", params=[pb.Param(name="x" * (70 << 20))])]
        self.assertEqual(capacities(huge, 0), (_rules.STEP_CHANNEL_MAX_CAPACITY,) * 2)


class UnimplementedTest(ChannelTestCase):
    SERVICER = PlainDaemon

    def test_a_daemon_without_channels_steps_over_grpc(self):
        self.assertFalse(self.client.open_step_channel(self.job, CAP, CAP))
        self.assertFalse(self.client.has_step_channel)
        self.assertEqual(self.shm_left(), [])
        self.assertEqual(self.step(step_id=4).step_id, 4)


@unittest.skipUnless(HAVE_CHANNELS, "Linux only")
class StepTest(ChannelTestCase):
    def test_steps_go_through_the_channel(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        for step_id in range(1, 6):
            response = self.step(step_id=step_id, skip_params=["b"])
            self.assertEqual((response.step_id, response.plan_version), (step_id, 7))
            self.assertEqual(list(response.skipped_nonfinite), ["w"])
        double = self.daemon.doubles[0]
        self.assertEqual([r.step_id for r in double.requests], [1, 2, 3, 4, 5])
        self.assertEqual(list(double.requests[0].skip_params), ["b"])
        self.assertEqual(self.daemon.grpc_requests, [])

    def test_a_refusal_raises_as_the_same_status_over_grpc(self):
        status = refusal_status()
        self.daemon.answer = lambda request: (RPC_STATUS, status)

        def over_grpc(request, context):
            context.set_trailing_metadata(((DETAILS_KEY, status),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "step 3: param 'w' has non-finite gradients")

        self.daemon.grpc_answer = over_grpc
        plain = self.new_client()
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        errors = []
        for client in (self.client, plain):
            with self.assertRaises(grpc.RpcError) as caught:
                self.step(client, step_id=3)
            errors.append(caught.exception)
        channel_error, grpc_error = errors
        self.assertIsInstance(channel_error, ChannelRpcError)
        self.assertEqual(channel_error.code(), grpc_error.code())
        self.assertEqual(channel_error.details(), grpc_error.details())
        self.assertEqual(error_info(channel_error), error_info(grpc_error))
        self.assertEqual(error_reason(channel_error), "REFUSED_BY_PEER")
        raised = [self.raised_by_rpc_result(e) for e in errors]
        self.assertEqual(*[(str(e), e.code, e.reason, e.metadata) for e in raised])
        self.assertTrue(self.client.has_step_channel)  # answered: still usable
        self.daemon.answer = applied
        self.assertEqual(self.step(step_id=3).step_id, 3)

    def test_an_unavailable_daemon_is_peer_gone_as_over_grpc(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        self.daemon.answer = lambda request: self.daemon.doubles[0].die()
        with self.assertRaises(ChannelRpcError) as caught:
            self.step()
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertFalse(self.client.has_step_channel)  # broken: closed
        gone = self.raised_by_rpc_result(caught.exception)
        dead = Client("unix:///nonexistent/muond.sock", timeout=5)
        self.addCleanup(dead.close)
        with self.assertRaises(grpc.RpcError) as over_grpc:
            dead.step(self.job, 1)
        gone_grpc = self.raised_by_rpc_result(over_grpc.exception, dead)
        self.assertEqual((gone.code, gone.reason), (gone_grpc.code, gone_grpc.reason))
        self.assertEqual(gone.metadata, {"daemon": self.address})
        self.assertEqual(self.step(step_id=1).step_id, 1)  # over gRPC now
        self.assertEqual(len(self.daemon.grpc_requests), 1)

    def test_a_daemon_gone_mid_wait_is_noticed_despite_frequent_signals(self):
        # A timer's signal every 20 ms ends each futex wait early (EINTR):
        # those waits check the daemon's lock too, else only a whole 0.5 s
        # slice would, and the step would wait for its timeout.
        client = self.new_client(timeout=8)
        self.assertTrue(client.open_step_channel(self.job, CAP, CAP))
        self.daemon.answer = lambda request: self.daemon.doubles[0].die()
        previous = signal.signal(signal.SIGALRM, lambda signum, frame: None)
        self.addCleanup(signal.signal, signal.SIGALRM, previous)
        self.addCleanup(signal.setitimer, signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
        started = time.monotonic()
        with self.assertRaises(ChannelRpcError) as caught:
            self.step(client)
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertLess(time.monotonic() - started, 4)  # the timeout is 8 s
        self.assertFalse(client.has_step_channel)

    def test_a_daemon_gone_before_the_step_sends_it_over_grpc_at_once(self):
        # The daemon's end went between steps (a daemon restarted on the
        # same socket): nothing was posted, so nothing is unknown; the step
        # goes over gRPC, not UNAVAILABLE after a wait slice.
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        self.assertEqual(self.step(step_id=1).step_id, 1)
        double = self.daemon.doubles[0]
        double.die()
        started = time.monotonic()
        self.assertEqual(self.step(step_id=2).step_id, 2)
        self.assertLess(time.monotonic() - started, 0.25)
        self.assertEqual([r.step_id for r in self.daemon.grpc_requests], [2])
        self.assertEqual([r.step_id for r in double.requests], [1])
        self.assertFalse(self.client.has_step_channel)
        self.assertFalse(double.trainer_lock_held())

    def raised_by_rpc_result(self, error, client=None) -> MuondError:
        """The MuondError muond.torch raises for ``error`` from ``client``."""
        def fail():
            raise error
        try:
            torch_rpc.result(fail, client or self.client, "Step 3")
        except MuondError as e:
            return e
        self.fail("rpc.result raised nothing")

    def test_an_answer_too_large_is_fetched_over_grpc_as_this_steps(self):
        self.daemon.answer = lambda request: (TOO_LARGE, b"x" * (CAP + 1))
        self.daemon.grpc_answer = lambda request, context: pb.StepResponse(
            step_id=request.step_id, replayed=True)
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        response = self.step(step_id=2, skip_params=["a"])
        self.assertEqual(response.step_id, 2)
        self.assertFalse(response.replayed)
        [sent] = self.daemon.doubles[0].requests
        self.assertEqual(self.daemon.grpc_requests, [sent])
        self.assertTrue(self.client.has_step_channel)
        channel = StepChannel.open(self.client, self.job, CAP, CAP)
        self.addCleanup(channel.close)
        with self.assertRaises(ChannelAnswerTooLarge):
            channel.step(pb.StepRequest(step_id=3), 5)

    def test_an_answer_too_large_kept_by_the_daemon_is_returned_as_it_was(self):
        # A daemon that keeps it (answers_kept) returns the channel's answer
        # itself over gRPC: a replay stays a replay.
        self.daemon.answers_kept = True
        self.daemon.answer = lambda request: (TOO_LARGE, b"x" * (CAP + 1))
        self.daemon.grpc_answer = lambda request, context: pb.StepResponse(
            step_id=request.step_id, replayed=True)
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        response = self.step(step_id=2)
        self.assertEqual(response.step_id, 2)
        self.assertTrue(response.replayed)
        [sent] = self.daemon.doubles[0].requests
        self.assertEqual(self.daemon.grpc_requests, [sent])

    def test_a_request_too_large_goes_over_grpc_and_the_channel_stays(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        names = [f"param-{i:05d}" for i in range(CAP // 10)]
        self.assertEqual(self.step(step_id=1, skip_params=names).step_id, 1)
        self.assertEqual(list(self.daemon.grpc_requests[0].skip_params), names)
        self.assertEqual(self.daemon.doubles[0].requests, [])
        self.assertEqual(self.step(step_id=2).step_id, 2)
        self.assertEqual(len(self.daemon.doubles[0].requests), 1)

    def delayed(self, seconds):
        """Answers every step after ``seconds`` (a GPU step's length)."""
        def answer(request):
            time.sleep(seconds)
            return applied(request)
        self.daemon.answer = answer

    def polls_of(self, channel) -> list:
        """The windows channel polls in (from, until, the answer seen)."""
        polls, poll = [], channel._poll_answer

        def spy(until):
            start = time.monotonic()
            poll(until)
            polls.append((start, until, channel._response_seq.value == channel._seq))
        channel._poll_answer = spy
        return polls

    def test_the_answer_is_polled_for_around_the_last_waits_length(self):
        self.delayed(0.06)
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP, answer_poll_s=0.02))
        polls = self.polls_of(self.client._step_channel)
        self.assertEqual(self.step(step_id=1).step_id, 1)
        self.assertEqual(polls, [])  # no wait before it to predict from
        for step_id in (2, 3):
            sent = time.monotonic()
            self.assertEqual(self.step(step_id=step_id).step_id, step_id)
            self.assertEqual(len(polls), step_id - 1)
            start, until, seen = polls[-1]
            # From 20 ms before the last wait's end (>= 60 ms after the
            # send), for at most 40 ms; the answer came within it.
            self.assertGreaterEqual(start - sent, 0.06 - 0.02 - 0.005)
            self.assertLessEqual(until - start, 0.04 + 1e-6)
            self.assertTrue(seen)
        self.assertEqual([r.step_id for r in self.daemon.doubles[0].requests], [1, 2, 3])

    def test_checks_alongside_do_not_move_the_poll(self):
        # The wait is counted from the request's sending: checks that run
        # after it (checks alongside) for longer than at the last step still
        # find the answer polled for, not slept through.
        self.delayed(0.08)
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP, answer_poll_s=0.02))
        channel = self.client._step_channel
        polls = self.polls_of(channel)

        def checks_taking(seconds):
            def checks():
                time.sleep(seconds)
                return True
            return checks
        for step_id, checks_s in ((1, 0.0), (2, 0.0), (3, 0.05)):
            sent = time.monotonic()
            answer = channel.step(pb.StepRequest(step_id=step_id), 5, checks_taking(checks_s))
            self.assertEqual(answer.step_id, step_id)
        # Step 3's checks ended 50 ms after the send; the answer came at
        # ~80 ms, inside the window from 60 ms (80 - 20) to 100 ms after the
        # send. Counted from the checks' end, the window would open at 110
        # ms: the answer slept through, no poll.
        self.assertEqual(len(polls), 2)
        start, until, seen = polls[-1]
        self.assertTrue(seen)
        self.assertLess(start - sent, 0.08)

    def test_an_answer_later_than_the_poll_is_waited_for_asleep(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP, answer_poll_s=0.01))
        polls = self.polls_of(self.client._step_channel)
        self.delayed(0.03)
        self.step(step_id=1)
        self.delayed(0.3)  # far past the predicted 30 ms and the poll's 20 ms
        self.assertEqual(self.step(step_id=2).step_id, 2)
        self.assertEqual(len(polls), 1)
        self.assertFalse(polls[0][2])  # the poll ended without the answer, then slept

    def test_short_waits_and_a_zero_poll_never_poll(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP, answer_poll_s=0.05))
        channel = self.client._step_channel
        polls = self.polls_of(channel)
        self.delayed(0.02)  # shorter than twice the poll: a CPU daemon's step
        for step_id in (1, 2, 3):
            self.step(step_id=step_id)
        channel.set_answer_poll(0.0)
        self.delayed(0.12)
        for step_id in (4, 5):
            self.step(step_id=step_id)
        self.assertEqual(polls, [])

    def test_a_poll_must_be_a_number_of_seconds_up_to_a_tenth(self):
        channel = self.open()
        self.addCleanup(channel.close)
        for bad in (-0.001, float("nan"), float("inf"), 0.2, True, "0.001", None, 10 ** 400):
            with self.subTest(bad=bad), self.assertRaisesRegex(
                    ValueError, "an answer poll must be a number of seconds in \\[0, 0.1\\]"):
                channel.set_answer_poll(bad)
        channel.set_answer_poll(0.1)  # the longest
        self.assertEqual(channel._poll_s, 0.1)

    def test_a_bad_poll_opens_no_channel(self):
        with self.assertRaisesRegex(ValueError, "an answer poll must be a number of seconds"):
            self.client.open_step_channel(self.job, CAP, CAP, answer_poll_s=-1)
        self.assertFalse(self.client.has_step_channel)
        self.assertEqual(self.daemon.doubles, [])

    def test_a_daemon_gone_or_a_close_during_the_poll_ends_it(self):
        for end in ("die", "close"):
            with self.subTest(end=end):
                client = self.new_client()
                self.assertTrue(client.open_step_channel(self.job, CAP, CAP, answer_poll_s=0.1))
                self.delayed(0.3)
                self.step(client, step_id=1)
                self.daemon.answer = lambda request: None  # a hung step
                double = self.daemon.doubles[-1]
                # Inside the poll (0.2 s to 0.4 s after the send).
                threading.Timer(0.25, double.die if end == "die"
                                else client.close_step_channel).start()
                sent = time.monotonic()
                with self.assertRaises(ChannelRpcError) as caught:
                    self.step(client, step_id=2)
                self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE
                                 if end == "die" else grpc.StatusCode.CANCELLED)
                # A close ends the poll at once; a daemon gone is seen at
                # the poll's end, not a slice (0.5 s) after it.
                self.assertLess(time.monotonic() - sent, 0.55 if end == "die" else 0.38)
                self.assertFalse(client.has_step_channel)

    def test_past_the_timeout_deadline_exceeded_and_the_channel_is_dropped(self):
        client = self.new_client(timeout=0.3)
        self.daemon.answer = lambda request: None  # a hung step
        self.assertTrue(client.open_step_channel(self.job, CAP, CAP))
        with self.assertRaises(ChannelRpcError) as caught:
            self.step(client, step_id=1)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(caught.exception.details(), "Deadline Exceeded")
        self.assertFalse(client.has_step_channel)
        double = self.daemon.doubles[0]
        self.assertEqual(double.ops, [_rules.STEP_CHANNEL_OP_STEP])  # no close op
        self.assertFalse(double.trainer_lock_held())
        self.assertEqual(self.step(client, step_id=1).step_id, 1)  # over gRPC
        self.assertEqual(len(self.daemon.grpc_requests), 1)

    def test_an_interrupt_while_waiting_breaks_the_channel(self):
        channel = self.open()
        self.addCleanup(channel.close)
        self.daemon.answer = lambda request: None
        previous = signal.signal(signal.SIGALRM, self._interrupt)
        self.addCleanup(signal.signal, signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with self.assertRaises(KeyboardInterrupt):
            channel.step(pb.StepRequest(step_id=1), None)
        self.assertTrue(channel.broken)
        with self.assertRaises(ChannelUnusable):
            channel.step(pb.StepRequest(step_id=1), None)

    @staticmethod
    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    def test_close_tells_the_daemon_once_and_drops_the_lock(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        self.step()
        self.client.close_step_channel()
        self.client.close_step_channel()
        double = self.daemon.doubles[0]
        double.thread.join(5)
        self.assertEqual(double.ops, [_rules.STEP_CHANNEL_OP_STEP, _rules.STEP_CHANNEL_OP_CLOSE])
        self.assertFalse(double.trainer_lock_held())
        self.assertEqual(self.step(step_id=2).step_id, 2)  # over gRPC
        self.assertEqual(len(self.daemon.grpc_requests), 1)

    def test_client_close_closes_the_channel(self):
        client = self.new_client()
        self.assertTrue(client.open_step_channel(self.job, CAP, CAP))
        client.close()
        self.daemon.doubles[0].thread.join(5)
        self.assertEqual(self.daemon.doubles[0].ops, [_rules.STEP_CHANNEL_OP_CLOSE])

    def test_a_busy_channel_refuses_a_second_thread(self):
        channel = self.open()
        self.addCleanup(channel.close)
        with channel._lock:
            with self.assertRaisesRegex(ChannelUnusable, "another thread"):
                channel.step(pb.StepRequest(step_id=1), 5)

    def test_close_during_a_step_cancels_it(self):
        channel = self.open()
        self.daemon.answer = lambda request: None
        threading.Timer(0.2, channel.close).start()
        with self.assertRaises(ChannelRpcError) as caught:
            channel.step(pb.StepRequest(step_id=1), None)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.CANCELLED)
        self.assertTrue(channel.closed)
        self.assertFalse(self.daemon.doubles[0].trainer_lock_held())

    def test_a_forked_child_never_uses_the_parents_channel(self):
        self.assertTrue(self.client.open_step_channel(self.job, CAP, CAP))
        channel = self.client._step_channel
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no gRPC here, only the channel
            try:
                channel.step(pb.StepRequest(step_id=1), 1)
                verdict = b"sent"
            except ChannelUnusable:
                verdict = b"unusable" if channel.closed else b"open"
            except BaseException:  # noqa: BLE001
                verdict = b"error"
            channel.close()
            os.write(write_end, verdict)
            os._exit(0)
        os.close(write_end)
        verdict = os.read(read_end, 64)
        os.close(read_end)
        os.waitpid(pid, 0)
        self.assertEqual(verdict, b"unusable")
        double = self.daemon.doubles[0]
        self.assertTrue(double.trainer_lock_held())  # the child dropped only its copy
        self.assertEqual(self.step(step_id=1).step_id, 1)
        self.assertEqual(double.ops, [_rules.STEP_CHANNEL_OP_STEP])
        self.assertEqual(self.daemon.grpc_requests, [])

    def test_a_child_forked_during_create_or_close_holds_no_channel(self):
        # A fork waits for a channel being created or closed: a child forked
        # between its descriptor's creation and its entry in the fork
        # handler's set (or its removal and close) kept a copy no handler
        # knew of, so the trainer's lock past the parent's death.
        prefix = f"{SHM_DIR}/muond-{self.job}-"
        stop = threading.Event()
        counts = {"forks": 0, "kept": 0}

        def holds_a_channel() -> bool:
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith(prefix):
                        return True
                except OSError:
                    pass
            return False

        def forker():
            while not stop.is_set():
                pid = os.fork()
                if pid == 0:
                    os._exit(1 if holds_a_channel() else 0)
                _, status = os.waitpid(pid, 0)
                counts["forks"] += 1
                counts["kept"] += os.waitstatus_to_exitcode(status) != 0

        thread = threading.Thread(target=forker)
        thread.start()
        try:
            for _ in range(3000):
                path = SHM_DIR + shm_name(self.job)
                channel = StepChannel._create(path, CAP, CAP)
                os.unlink(path)
                channel.close()
        finally:
            stop.set()
            thread.join()
        self.assertGreater(counts["forks"], 0)
        self.assertEqual(counts["kept"], 0, counts)


if __name__ == "__main__":
    unittest.main()
