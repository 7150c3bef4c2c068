"""muond.torch.rpc.gather, the one call on every daemon: after a daemon's call
fails, the others get a grace to finish (one past a step's commit vote is still
writing trainer memory) before the failure is raised; one that never answers
is cancelled once the grace is over, so the trainer never hangs on it. Fake
futures with the grpc.Future surface gather uses."""
import threading
import time
import unittest

import grpc

from muond.client import REFUSED_BY_PEER, MuondError
from muond.torch import rpc
from muond.v1 import error_details_pb2


class FakeRpcError(grpc.RpcError):
    """A failed call; with `reason`, muond's ErrorInfo in its trailing
    metadata as the daemon sends it (proto/status_details.cc)."""

    def __init__(self, reason=None, details="the daemon stopped"):
        super().__init__()
        self.reason, self._details = reason, details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE if self.reason is None else \
            grpc.StatusCode.INVALID_ARGUMENT

    def details(self):
        return self._details

    def trailing_metadata(self):
        if self.reason is None:
            return ()
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain="muond.dev")
        status = error_details_pb2.RpcStatus(code=self.code().value[0], message=self._details)
        status.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo",
                           value=info.SerializeToString())
        return (("grpc-status-details-bin", status.SerializeToString()),)


class FakeFuture:
    """Finishes after `after_s` (None: never, until cancelled) with `value`
    or, when `fails`, a FakeRpcError."""

    def __init__(self, after_s, value=None, fails=False, error=None):
        self._done = threading.Event()
        self._callbacks = []
        self._lock = threading.Lock()
        self.value, self.fails, self.cancelled = value, fails or error is not None, False
        self.error = error or FakeRpcError()
        if after_s is not None:
            threading.Timer(after_s, self._finish).start()

    def _finish(self):
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            callbacks = list(self._callbacks)
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb):
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def done(self):
        return self._done.is_set()

    def exception(self):
        if self.cancelled:
            raise grpc.FutureCancelledError()  # as grpc's futures do
        return self.error if self.fails else None

    def result(self):
        if self.cancelled:
            raise grpc.FutureCancelledError()
        if self.fails:
            raise self.error
        return self.value

    def cancel(self):
        """A pending call's cancel: done from now on, callbacks run."""
        with self._lock:
            if self._done.is_set():
                return
            self.cancelled = True
        self._finish()


class Client:
    def __init__(self, address):
        self.address = address


CLIENTS = [Client("unix:///tmp/d0.sock"), Client("unix:///tmp/d1.sock")]


class GatherTest(unittest.TestCase):
    def test_all_answer_in_rank_order(self):
        futures = [FakeFuture(0.05, "r0"), FakeFuture(0.0, "r1")]
        self.assertEqual(rpc.gather(futures, CLIENTS, "Step"), ["r0", "r1"])

    def test_a_failure_waits_for_a_peer_that_is_still_committing(self):
        committing = FakeFuture(0.3, "r1")
        t0 = time.monotonic()
        with self.assertRaises(MuondError) as raised:
            rpc.gather([FakeFuture(0.0, fails=True), committing], CLIENTS, "Step",
                       grace_s=5.0)
        waited = time.monotonic() - t0
        self.assertTrue(committing.done())
        self.assertFalse(committing.cancelled)
        self.assertGreaterEqual(waited, 0.25)
        self.assertLess(waited, 4.0)  # not the whole grace: it answered
        self.assertIn("d0.sock", str(raised.exception))

    def test_a_peer_that_never_answers_is_cancelled_after_the_grace(self):
        silent = FakeFuture(None)
        t0 = time.monotonic()
        with self.assertRaises(MuondError):
            rpc.gather([silent, FakeFuture(0.0, fails=True)], CLIENTS, "Step",
                       grace_s=0.3)
        waited = time.monotonic() - t0
        self.assertTrue(silent.cancelled)
        self.assertGreaterEqual(waited, 0.25)
        self.assertLess(waited, 3.0)

    def test_the_first_failure_is_raised(self):
        with self.assertRaises(MuondError) as raised:
            rpc.gather([FakeFuture(0.2, fails=True), FakeFuture(0.0, fails=True)],
                       CLIENTS, "Step", grace_s=1.0)
        self.assertIn("d1.sock", str(raised.exception))

    def test_the_refusers_answer_is_raised_not_a_peers_echo(self):
        # Rank 1 refused the step (its answer names the param); rank 0's
        # answer, first to arrive, only says rank 1 refused.
        echo = FakeRpcError(REFUSED_BY_PEER, "step 3 refused on every rank of the job: "
                            "refused by rank 1 (non-finite gradients)")
        detail = FakeRpcError(None, "non-finite gradients (NaN or Inf) in: dense/w2")
        with self.assertRaises(MuondError) as raised:
            rpc.gather([FakeFuture(0.0, error=echo), FakeFuture(0.2, error=detail)],
                       CLIENTS, "Step", grace_s=2.0)
        self.assertIn("dense/w2", str(raised.exception))
        self.assertIn("d1.sock", str(raised.exception))
        # Only echoes (the refuser never answered): the first one is raised.
        with self.assertRaises(MuondError) as raised:
            rpc.gather([FakeFuture(0.0, error=echo), FakeFuture(None)], CLIENTS, "Step",
                       grace_s=0.2)
        self.assertEqual(raised.exception.reason, REFUSED_BY_PEER)
        self.assertIn("d0.sock", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
