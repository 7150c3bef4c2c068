"""muond.torch.rpc.gather, the one call on every daemon: after a daemon's call
fails, the others get a grace to finish (one past a step's commit vote is still
writing trainer memory) before the failure is raised; one that never answers
is cancelled once the grace is over, so the trainer never hangs on it. Fake
futures with the grpc.Future surface gather uses."""
import threading
import time
import unittest

import grpc

from muond.client import MuondError
from muond.torch import rpc


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the daemon stopped"


class FakeFuture:
    """Finishes after `after_s` (None: never, until cancelled) with `value`
    or, when `fails`, a FakeRpcError."""

    def __init__(self, after_s, value=None, fails=False):
        self._done = threading.Event()
        self._callbacks = []
        self._lock = threading.Lock()
        self.value, self.fails, self.cancelled = value, fails, False
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
        return FakeRpcError() if self.fails else None

    def result(self):
        if self.fails:
            raise FakeRpcError()
        return self.value

    def cancel(self):
        self.cancelled = True


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


if __name__ == "__main__":
    unittest.main()
