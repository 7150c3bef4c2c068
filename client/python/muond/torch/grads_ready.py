"""The grads-ready event (``grads_ready_event``): how a trainer with CUDA
params tells its daemons that a step's grads are written.

The daemons read the grads from another process, so they must not start
before backward's kernels end. Without the event the trainer synchronises
its device before each step, and the step's request, the daemon's wake-up
and its first launches all wait for backward's last kernel. With it, the
trainer registers an interprocess CUDA event per device
(RegisterParamsRequest.grads_ready_event) and records it on the current
stream where it synchronised before; each daemon waits until that record
completed before its step reads a grad, and the request travels while
backward's tail still runs. The same contract as torch.optim: the
grads are ready on the current stream (backward and FSDP2 leave them so).

Only daemons that answer ``waits_for_grads_ready_event`` get the record;
if any daemon of the optimizer does not (an older daemon, a host daemon,
regions on more than one device), the trainer synchronises as before."""
from __future__ import annotations

import torch

from muond.v1 import muond_pb2 as pb


class GradsReady:
    """One optimizer's events (one per CUDA device its daemons read from)
    and whether every daemon waits for them."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._events: dict[int, torch.cuda.Event] = {}
        self._recorded: list[torch.cuda.Event] = []  # empty: synchronise

    def handle(self, regions) -> bytes:
        """The event handle to register with ``regions`` (one daemon's
        pb.MemoryRegion list): b"" unless on, every region CUDA memory of
        one device."""
        if not self.enabled or not regions:
            return b""
        if any(r.kind != pb.MEMORY_KIND_CUDA_IPC for r in regions):
            return b""
        devices = {r.device for r in regions}
        if len(devices) != 1:
            return b""
        return bytes(self._event(devices.pop()).ipc_handle())

    def _event(self, device: int) -> torch.cuda.Event:
        event = self._events.get(device)
        if event is None:
            # The event lives as long as the optimizer: a daemon that opened
            # its handle may wait for it at any step of the registration.
            with torch.cuda.device(device):
                event = torch.cuda.Event(interprocess=True)
                event.record()  # created on this device, and complete
            self._events[device] = event
        return event

    def registered(self, responses, regions_per_daemon) -> None:
        """After RegisterParams answered ``responses`` (one per daemon, for
        the regions ``regions_per_daemon``): record for the steps only if
        every daemon waits."""
        self._recorded = []
        handles = [self.handle(regions) for regions in regions_per_daemon]
        if not responses or not all(handles):
            return
        if not all(r is not None and r.waits_for_grads_ready_event for r in responses):
            return
        devices = {next(iter(regions)).device for regions in regions_per_daemon}
        self._recorded = [self._events[d] for d in sorted(devices)]

    @property
    def daemons_wait(self) -> bool:
        """Every daemon's steps wait for the event (no synchronisation)."""
        return bool(self._recorded)

    def before_step(self) -> None:
        """Where the daemons may start reading the grads: the event recorded
        on each device's current stream, or the device synchronised."""
        if not self._recorded:
            torch.cuda.synchronize()
            return
        for event in self._recorded:
            event.record(torch.cuda.current_stream(event.device))
