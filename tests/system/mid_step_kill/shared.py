"""What both roles of kill_mid_step.py share: the daemon log lines the kill
waits for, the bounds its options are checked against, the bitwise
comparison of tensors and the small CharGPT's options."""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt")
# What a daemon run with --testonly_commit_delay_ms logs (core/step/layer_sharded_muon.cc).
STARTED = "testonly_commit_delay_ms: step {step}: started"
EXCHANGED = "testonly_commit_delay_ms: step {step}: exchanges done (ok)"
# --kill-at commit: the least --commit-delay-ms accepted. The victim's trainer
# polls its daemon's log every 5 ms and kills at once (the pid looked up
# before the step): from the daemon's "exchanges done" to the kill sent took
# 1.0-5.6 ms in 6 runs (2 and 4 ranks, this 2-core machine with every
# process busy), 20 ms at worst seen (a CI run beside another job). 200 ms
# is ten times that, room for a scheduler stall on a loaded host; the
# landing check still measures each run (a kill after the window is a FAIL,
# whatever the delay).
MIN_COMMIT_DELAY_MS = 200
# The least --timeout beyond --comm-timeout-s: starting the trainers and
# daemons and the steps before the kill (about 10 s on 2 CPU ranks, more with
# CUDA and NCCL), so that a survivor waiting out its comm timeout (a dead peer
# unseen) still ends inside the launch and every line is checked.
MIN_TIMEOUT_OVER_COMM_S = 30
# The driver's own work after --timeout (stopping what is left, JSON): the
# most a caller's hard cap must leave beyond --timeout.
CLEANUP_S = 15
VOCAB = 32
CONTEXT = 16
# A trainer exits at most this long after a SIGTERM: torchrun SIGKILLs its
# workers 30 s after passing the SIGTERM on (not configurable), so
# --comm-timeout-s stays below it.
TERM_GRACE_S = 30.0


def same_bits(a, b) -> bool:
    """Bitwise equality of two tensors (NaN and -0.0 included)."""
    import torch
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def differing(before: dict, after: dict) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    return sorted(k for k in before.keys() | after.keys()
                  if k not in before or k not in after or not same_bits(before[k], after[k]))


def layout_args(a, world: int):
    """train_dist.py's own options (its parser, options.dist_parser: no
    torch) for a small CharGPT in layout a.parallel on `world` ranks: heads
    a multiple of the TP size, a global batch of 2 per data-parallel rank."""
    sys.path.insert(0, CHAR_GPT)
    from options import dist_parser, dp_size, tp_size
    probe = dist_parser().parse_args(["--parallel", a.parallel, "--inner", str(a.inner)])
    heads = max(2, tp_size(probe, world))
    return dist_parser().parse_args([
        "--parallel", a.parallel, "--inner", str(a.inner), "--layers", "1",
        "--heads", str(heads), "--d-model", str(16 * heads), "--context", str(CONTEXT),
        "--batch", str(2 * max(1, dp_size(probe, world))), "--device", a.device,
        "--lr", "0.02", "--adamw-lr", "0.01", "--wait-healthy", "60"])

