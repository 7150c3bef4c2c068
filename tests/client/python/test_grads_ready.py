"""muond.torch.grads_ready's decisions without a GPU: which registrations
carry an event handle, when the steps record the event instead of
synchronising the device, and the option's check. (The event itself, and a
daemon waiting for it, are tests/gpu/test_grads_ready_cuda.py.)"""
from __future__ import annotations

import types
import unittest
from unittest import mock

import muond.torch
from muond.torch import grads_ready
from muond.v1 import muond_pb2 as pb

HANDLE = b"h" * 64


class StubEvent:
    """A torch.cuda.Event's surface that GradsReady uses."""

    def __init__(self, device: int):
        self.device = device
        self.recorded_on = []

    def ipc_handle(self):
        return HANDLE

    def record(self, stream=None):
        self.recorded_on.append(stream)


class StubbedGradsReady(grads_ready.GradsReady):
    def _event(self, device):
        return self._events.setdefault(device, StubEvent(device))


def cuda(device: int) -> pb.MemoryRegion:
    return pb.MemoryRegion(name=f"cuda{device}", kind=pb.MEMORY_KIND_CUDA_IPC,
                           cuda_ipc_handle=b"m" * 64, byte_size=1024, device=device)


SHM = pb.MemoryRegion(name="/muond-x", kind=pb.MEMORY_KIND_HOST_SHM, shm_name="/muond-x",
                      byte_size=1024)


def answer(waits: bool) -> pb.RegisterParamsResponse:
    return pb.RegisterParamsResponse(num_params=1, waits_for_grads_ready_event=waits)


class HandleTest(unittest.TestCase):
    def test_only_cuda_memory_of_one_device_gets_a_handle(self):
        on = StubbedGradsReady(True)
        self.assertEqual(on.handle([cuda(0), cuda(0)]), HANDLE)
        self.assertEqual(on.handle([cuda(1)]), HANDLE)
        self.assertEqual(on.handle([SHM]), b"")
        self.assertEqual(on.handle([cuda(0), SHM]), b"")
        self.assertEqual(on.handle([cuda(0), cuda(1)]), b"")
        self.assertEqual(on.handle([]), b"")
        self.assertEqual(StubbedGradsReady(False).handle([cuda(0)]), b"")


class StepTest(unittest.TestCase):
    def before_step(self, ready):
        """before_step() with torch.cuda's calls stubbed: whether it
        synchronised, and each device's current stream."""
        synced = []
        with mock.patch.object(grads_ready.torch.cuda, "synchronize",
                               lambda: synced.append(True)), \
             mock.patch.object(grads_ready.torch.cuda, "current_stream",
                               lambda device: f"stream{device}"):
            ready.before_step()
        return bool(synced)

    def test_every_daemon_waiting_records_instead_of_synchronising(self):
        ready = StubbedGradsReady(True)
        regions = [[cuda(0)], [cuda(1)]]
        ready.registered([answer(True), answer(True)], regions)
        self.assertTrue(ready.daemons_wait)
        self.assertFalse(self.before_step(ready))
        self.assertEqual(ready._events[0].recorded_on, ["stream0"])
        self.assertEqual(ready._events[1].recorded_on, ["stream1"])

    def test_one_daemon_not_waiting_means_synchronising(self):
        for answers, regions in [
                ([answer(True), answer(False)], [[cuda(0)], [cuda(1)]]),  # an older daemon
                ([answer(True), None], [[cuda(0)], [cuda(1)]]),
                ([answer(True), answer(True)], [[cuda(0)], [SHM]]),  # no handle sent
                ([], [])]:
            ready = StubbedGradsReady(True)
            ready.registered(answers, regions)
            self.assertFalse(ready.daemons_wait, (answers, regions))
            self.assertTrue(self.before_step(ready))
            for event in ready._events.values():
                self.assertEqual(event.recorded_on, [])

    def test_a_registration_without_waiting_daemons_stops_the_recording(self):
        ready = StubbedGradsReady(True)
        ready.registered([answer(True)], [[cuda(0)]])
        self.assertTrue(ready.daemons_wait)
        ready.registered([answer(False)], [[cuda(0)]])  # registered again, elsewhere
        self.assertFalse(ready.daemons_wait)

    def test_off_never_records(self):
        ready = StubbedGradsReady(False)
        ready.registered([answer(True)], [[cuda(0)]])
        self.assertFalse(ready.daemons_wait)
        self.assertTrue(self.before_step(ready))


class OptionTest(unittest.TestCase):
    def test_the_option_must_be_a_bool(self):
        param = types.SimpleNamespace()  # never reached: the option is checked first
        with self.assertRaisesRegex(ValueError, "grads_ready_event must be a bool, got 'yes'"):
            muond.torch.Muon([param], daemons=["unix:///nonexistent"], job_id="j",
                             grads_ready_event="yes")


if __name__ == "__main__":
    unittest.main()
