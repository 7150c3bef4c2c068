"""What the torchrun-style tests (test_torchrun_local, test_dtensor_memory)
share: their param groups and the plumbing of their spawned trainers."""
import json
import os
import time

ADAMW = dict(algorithm="adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)


def groups(named):
    """A Muon group of the 2-D params and an AdamW group of the rest."""
    return [{"params": [(n, p) for n, p in named if p.ndim == 2]},
            {"params": [(n, p) for n, p in named if p.ndim != 2], **ADAMW}]


def wait_for_json(path: str, what: str, timeout: float = 60) -> dict:
    """The JSON file the parent writes once its servers run (they start after
    the fork, so no gRPC state is forked)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what}")
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def join(ctx, timeout: float) -> None:
    """Waits for the trainers; a trainer that fails raises, and trainers
    still running after `timeout` s (a rank left waiting) are killed."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"trainers still running after {timeout:.0f}s")
