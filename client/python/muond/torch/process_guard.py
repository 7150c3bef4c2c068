"""What only the process that made an optimizer may do, and how a step's
answer shows that the step was this optimizer's own.

A forked child (os.fork, multiprocessing's "fork" start method, a DataLoader
worker) holds a copy of its parent's optimizer: the same registration,
client id, shared memory and step ids. A step from that copy is applied for
the parent, and the parent's next step, sending the same id, is answered
from the daemons' record as a replay: it changes nothing, silently.
"""
from __future__ import annotations

import os


def check_creator_process(creator_pid: int, what: str) -> None:
    """RuntimeError naming both processes and the fix when `what` (a method
    of muond.torch.Muon) is called in a process other than the one that
    made the optimizer; before anything is sent."""
    pid = os.getpid()
    if pid == creator_pid:
        return
    raise RuntimeError(
        f"muond.torch.Muon.{what} called in process {pid}, but this optimizer was made in "
        f"process {creator_pid}: this process is a fork of it (os.fork, multiprocessing's "
        "'fork' start method, a DataLoader worker), and its copy of the optimizer shares the "
        "parent's registration and step ids, so a step here would be applied for the parent "
        "and the parent's own next step would change nothing. Make the optimizer in this "
        "process (a new muond.torch.Muon here, on its own params), or call it only in the "
        "process that made it")


class ReplayCheck:
    """A daemon answers a step id it applied already from its record
    (``StepResponse.replayed``). That is right for a resend of a step whose
    answer this optimizer never got (an RPC error after the daemons applied
    it) and wrong for any other: then another process stepped this
    optimizer's registration and this step applied nothing."""

    def __init__(self):
        self._unanswered: int | None = None  # sent, its outcome unknown

    def sent_without_answer(self, step_id: int) -> None:
        """Step `step_id` was sent and failed: a resend may be a replay."""
        self._unanswered = step_id

    def check(self, step_id: int, responses, client_id: str) -> None:
        """RuntimeError when a response replays `step_id` that was not sent
        before without an answer; otherwise the step is this optimizer's."""
        if any(r.replayed for r in responses) and self._unanswered != step_id:
            raise RuntimeError(
                f"muond.torch.Muon.step: the daemons answered step {step_id} from their record "
                f"(already applied, a replay), but this optimizer never sent step {step_id} "
                "before: another process stepped its registration (a forked child calling "
                "step() on its copy of this optimizer, or another trainer with the same "
                f"client_id {client_id!r}), so this step applied nothing and the params hold "
                "that process's update. Build a new optimizer (each process its own, made in "
                "that process; each trainer its own client_id) and load this one's "
                "state_dict() if you need it")
        self._unanswered = None
