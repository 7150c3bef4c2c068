#!/usr/bin/env python3
"""The trainer's wake-up at the end of a step, sleeping or polling for the
daemon's answer (muond.step_channel StepChannel.set_answer_poll; Muon's
``step_channel_poll_ms``): why a trainer whose daemon runs the step on a GPU
polls over the last stretch of it.

A daemon-side double of the step channel (tests/client/python/
step_channel_double.py, the daemon's protocol in Python) answers each step
after --step-ms of work done elsewhere (a GPU step: the trainer has nothing
to do but wait). Per step this times, in one clock, the double's answer
(just before it publishes response_seq and wakes the futex) to the moment
``Client.step`` returns in the trainer: the trainer's wake-up plus reading
the answer. Runs with and without polling alternate (A B A B) so that drift
weighs on both. p50 / p90 µs.

    .venv/bin/python bench/step_channel_poll.py --steps 120 --step-ms 25
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The daemon-side double; muond is the package deploy/setup.sh installed.
sys.path.insert(0, os.path.join(ROOT, "tests", "client", "python"))

import grpc  # noqa: E402

import muond  # noqa: E402
from muond import _rules  # noqa: E402
from muond.client import Client  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from muond.v1 import muond_pb2_grpc as pb_grpc  # noqa: E402
from step_channel_double import STEP_RESPONSE, ChannelDouble  # noqa: E402


class SlowDaemon(pb_grpc.OptimizerServicer):
    """Opens step channels whose double answers after ``step_s``, noting
    when (time.perf_counter) it did."""

    def __init__(self, step_s: float):
        self.step_s, self.answered, self.doubles = step_s, [], []

    def OpenStepChannel(self, request, context):
        def answer(step):
            time.sleep(self.step_s)
            self.answered.append(time.perf_counter())
            return STEP_RESPONSE, pb.StepResponse(step_id=step.step_id).SerializeToString()
        self.doubles.append(ChannelDouble(request.shm_name, answer))
        return pb.OpenStepChannelResponse(version=_rules.STEP_CHANNEL_VERSION)


def run(address: str, daemon: SlowDaemon, poll_s: float, steps: int, warmup: int) -> list:
    """µs from each answer to Client.step's return, after the warm-up."""
    client = Client(address, timeout=60)
    try:
        if not client.open_step_channel(f"poll{uuid.uuid4().hex[:8]}", 1 << 16, 1 << 16,
                                        answer_poll_s=poll_s):
            raise SystemExit("no step channel on this host (Linux only)")
        out = []
        for step_id in range(1, warmup + steps + 1):
            client.step("poll", step_id)
            returned = time.perf_counter()
            if step_id > warmup:
                out.append((returned - daemon.answered[-1]) * 1e6)
        return out
    finally:
        client.close()
        for d in daemon.doubles:
            d.stop()
        daemon.doubles.clear()


def pct(values: list, q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=25.0,
                    help="the daemon's step (a GPU step the trainer waits for)")
    ap.add_argument("--poll-ms", type=float, default=1.0, help="the polling runs' poll")
    a = ap.parse_args()
    if not 0 < a.poll_ms <= 100 or 2 * a.poll_ms > a.step_ms:
        ap.error("--poll-ms must be in (0, 100] and at most half of --step-ms (a step "
                 "whose wait is shorter than twice the poll does not poll)")
    with tempfile.TemporaryDirectory(prefix="muond-poll-") as tmp:
        daemon = SlowDaemon(a.step_ms / 1e3)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_OptimizerServicer_to_server(daemon, server)
        address = f"unix://{tmp}/d.sock"
        server.add_insecure_port(address)
        server.start()
        try:
            runs = {0.0: [], a.poll_ms: []}
            for poll_ms in (0.0, a.poll_ms, 0.0, a.poll_ms):
                runs[poll_ms] += run(address, daemon, poll_ms / 1e3, a.steps, a.warmup)
        finally:
            server.stop(None)
    print(f"muond from {os.path.dirname(muond.__file__)}; {a.steps} steps per run after "
          f"{a.warmup} warm-up, runs A B A B; a {a.step_ms:g} ms daemon step\n")
    print("| trainer waits | answer → `step()` returned, p50 / p90 µs | p50 ÷ asleep's |\n"
          "|---|---|---|")
    asleep = pct(runs[0.0], 0.5)
    for poll_ms, values in runs.items():
        what = ("asleep (futex)" if poll_ms == 0
                else f"polling, `step_channel_poll_ms={poll_ms:g}`")
        print(f"| {what} | {pct(values, 0.5):.0f} / {pct(values, 0.9):.0f} | "
              f"{pct(values, 0.5) / asleep:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
