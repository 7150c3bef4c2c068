#!/usr/bin/env python3
"""A daemon SIGKILLed in the middle of a step of the torchrun main job.

    python tests/system/kill_mid_step.py --nproc 2 --parallel fsdp --device cpu
    python tests/system/kill_mid_step.py --nproc 8 --parallel fsdp+tp --device cuda \\
        --kill-at collective --bin-dir BUNDLE/bin --out kill.json

runs `muond launch --nproc-per-node N --device D -- torchrun --nproc-per-node N
kill_mid_step.py --trainer ...`: N trainer processes (gloo on CPU, NCCL with
one GPU each on CUDA) train examples/char_gpt's CharGPT (one small layer,
random tokens) in the layout --parallel (train_dist.py's build_mesh,
apply_layout and build_optimizer: DDP, FSDP2, TP, FSDP2 x TP, HSDP) for
--steps steps through muond.torch.Muon, one muond-daemon per rank. Step
--steps + 1 is the kill step:

* every trainer snapshots its params (its local shards, and for DTensor
  params also the shared buffers the daemon writes) and its daemon's
  optimizer state (ExportState: momentum, AdamW moments and step counts,
  the state's step id) right before `opt.step()`;
* the victim rank's trainer SIGKILLs its own daemon from inside that
  `opt.step()`: its client's Step RPC is wrapped (KillInsideStep). The
  daemons run with --testonly_commit_delay_ms, which makes them log
  "testonly_commit_delay_ms: step S: started" when a step begins and
  "...: step S: exchanges done (ok)" before sleeping that long ahead of the
  commit vote. The victim's trainer kills when the line it waits for
  appears. --kill-at:
  commit      the RPC goes out; once the victim's daemon logs its exchanges
              done, the kill: after the job vote (which every rank takes
              part in, so every survivor's daemon is inside step S too) and
              after the victim's momentum, exchanges and Newton-Schulz,
              before any rank's commit (the survivors then fail in the
              commit vote);
  collective  once every survivor's daemon logs step S started, the kill
              (then the RPC, which fails): the survivors wait for the
              victim's daemon in the step's first collective (a domain
              agreement, or the job vote), and cannot leave step S without
              it. On GPUs that collective is NCCL's where the domain spans
              the victim (the job vote is Gloo in both modes).

Checked (each a line of the summary, all in --out's JSON):
* the kill landed inside step S before any rank could commit it, proven
  from the daemons' own log times (the driver runs the job with TZ=UTC and
  reads them back), not from the trainer having seen a line: commit: the
  SIGKILL (the time kill() returned) came after the victim's daemon logged
  "exchanges done" and before that line's time plus the wait it names
  (the daemon sleeps at least that long before its commit vote, and no rank
  commits without its ballot), and its Step RPC had not returned (the reply
  follows the commit); collective: every survivor's daemon logged "step S:
  started" before the SIGKILL, and the victim's daemon never did (its Step
  RPC went out after the kill; no rank commits a step one rank never
  began). The daemon logs no line at its commit, so a kill after the wait
  is a FAIL even where the vote may still have been pending: not proven is
  not passed;
* every surviving trainer's `opt.step()` raises: a MuondError, UNAVAILABLE
  with reason PEER_GONE, whose message names the dead rank ("dead rank V")
  and says the peer is gone (a transport error, not "did not answer in time",
  which is what the comm timeout would say: the daemons run with
  --comm-timeout-s, 20 by default) in under half that timeout after the
  kill (the seconds are reported; a survivor that waits out the whole comm
  timeout, its peer's death unseen, fails this line and the others are
  still checked);
* the victim's own `opt.step()` raises naming its daemon's socket;
* every survivor's params, shared buffers and optimizer state (and state step
  id) after the failure are bitwise what they were before the step: nothing
  of it was applied (the victim's params too: its daemon died before its
  commit); the job did train before (params moved from their initial values);
* each survivor's daemon reports itself not ready (Health: no plan, an
  engine error saying to re-register);
* `muond launch` exits 1 naming the dead daemon ("FAILED: daemon rank V (pid
  P) killed by signal 9 (SIGKILL)", P the pid the victim killed);
* nothing is left: no process naming the job or this run's directory, no
  socket directory /tmp/muond-<job>-*, no /dev/shm/muond-<job>-* object.

The launcher stops the command (SIGTERM to torchrun, which passes it on) as
soon as it sees the daemon die, usually before the survivors' step has
raised: the trainers note the SIGTERM and finish their check first (bounded:
they exit at most 30 s after it), as the measuring device of this script; a
real trainer would simply be stopped.

Options that cannot run the check are refused before anything starts (exit
2, each naming the option and its rule: --nproc's layout rule is
train_dist.py's, examples/char_gpt/options.py). --timeout bounds the launch;
when it runs out, or the driver gets SIGTERM or SIGINT (a caller's
`timeout`), the driver SIGKILLs what is left of the job, removes its socket
dirs and shm objects, and still prints its checks and writes --out, within
15 s: under a hard cap of C seconds pass --timeout C - 15 or less
(bench/gpu_multigpu_jobs.sh runs each kill case under `timeout 120`: --timeout
100).
"""
from __future__ import annotations

import argparse
import os
import sys

# The package beside this file, whether run as a script (torchrun runs it
# again as each trainer) or imported.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mid_step_kill.shared import (CHAR_GPT, CLEANUP_S, MIN_COMMIT_DELAY_MS,  # noqa: E402
                                  MIN_TIMEOUT_OVER_COMM_S, TERM_GRACE_S, layout_args)


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each option's default (unless None or a
    flag's False: those say in words what they mean)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def problems(a) -> list[str]:
    """What makes the driver's options unable to run the check, each naming
    the option and its rule (empty: they can). Nothing is started first."""
    out = []
    if a.nproc < 2:
        out.append(f"--nproc {a.nproc}: needs >= 2 (a victim and a survivor)")
    elif not 0 <= a.victim < a.nproc:
        out.append(f"--victim {a.victim}: must be a rank of --nproc {a.nproc} "
                   f"(0..{a.nproc - 1})")
    if a.steps < 1:
        out.append(f"--steps {a.steps}: needs >= 1 (the job trains that many steps before "
                   "the kill step; the check that it trained needs one)")
    if a.inner < 1:
        out.append(f"--inner {a.inner}: needs >= 1")
    elif a.nproc >= 1:
        sys.path.insert(0, CHAR_GPT)
        from options import check_layout
        try:  # train_dist.py's rule, worded with this script's --nproc
            check_layout(layout_args(a, a.nproc), a.nproc, launcher=True)
        except ValueError as e:
            out.append(str(e))
    if not 1 <= a.comm_timeout_s < TERM_GRACE_S:
        out.append(f"--comm-timeout-s {a.comm_timeout_s}: must be in [1, {TERM_GRACE_S:g}) "
                   "(torchrun stops the trainers that long after the launcher's SIGTERM)")
    if a.kill_at == "commit":
        most = a.comm_timeout_s * 250
        if not MIN_COMMIT_DELAY_MS <= a.commit_delay_ms <= most:
            out.append(f"--commit-delay-ms {a.commit_delay_ms} with --kill-at commit: must be in "
                       f"[{MIN_COMMIT_DELAY_MS}, {most}]: at least {MIN_COMMIT_DELAY_MS} so the "
                       "victim's trainer, polling its daemon's log, kills inside that window; at "
                       "most --comm-timeout-s x 250 since the survivors sleep the same window "
                       "before their commit vote and must fail in under half --comm-timeout-s "
                       "after the kill")
    elif a.commit_delay_ms < 1:
        out.append(f"--commit-delay-ms {a.commit_delay_ms} with --kill-at collective: needs "
                   ">= 1 (the daemons log 'step S: started' only with it set)")
    least = a.comm_timeout_s + MIN_TIMEOUT_OVER_COMM_S
    if a.timeout < least:
        out.append(f"--timeout {a.timeout:g}: needs >= --comm-timeout-s + "
                   f"{MIN_TIMEOUT_OVER_COMM_S} = {least:g} s (the startup and the steps before "
                   "the kill, and a survivor that waits out its comm timeout)")
    if a.bin_dir and not os.path.isdir(a.bin_dir):
        out.append(f"--bin-dir {a.bin_dir}: no such directory")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        out.append(f"--out {a.out}: its directory does not exist")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nproc", type=int, default=2, help="ranks: trainers and daemons (>= 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: host-mode daemons, gloo; cuda: one GPU per rank, NCCL")
    p.add_argument("--parallel", choices=["ddp", "fsdp", "tp", "fsdp+tp", "hsdp"],
                   default="fsdp", help="the layout (train_dist.py's)")
    p.add_argument("--inner", type=int, default=2,
                   help="inner mesh dim of fsdp+tp / hsdp (--nproc a multiple of it)")
    p.add_argument("--steps", type=int, default=2,
                   help="steps trained before the kill step (>= 1)")
    p.add_argument("--victim", type=int, default=None,
                   help="rank whose daemon is killed (default: the last)")
    p.add_argument("--kill-at", choices=["commit", "collective"], default="commit",
                   help="commit: the victim's daemon between its exchanges and the commit "
                   "vote; collective: the survivors' daemons inside the step, waiting for the "
                   "victim in the step's first collective (the victim's daemon never gets it)")
    p.add_argument("--commit-delay-ms", type=int, default=None,
                   help="the daemons' --testonly_commit_delay_ms: the window the commit kill "
                   f"lands in, {MIN_COMMIT_DELAY_MS} to --comm-timeout-s x 250 (default 1000; "
                   "1 with --kill-at collective, which needs only the log lines it turns on)")
    p.add_argument("--comm-timeout-s", type=int, default=20,
                   help="the daemons' --comm_timeout_s (< 30: torchrun's stop grace); "
                   "survivors must fail in under half of it")
    p.add_argument("--bin-dir", help="muond-daemon and muond-coordinator (muond launch "
                   "--bin-dir; default: its own lookup)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for the whole launch (>= --comm-timeout-s + "
                   f"{MIN_TIMEOUT_OVER_COMM_S}); then the driver stops what is left and "
                   f"writes its result, within {CLEANUP_S} s more: under a hard cap (a "
                   f"`timeout C`) pass at most C - {CLEANUP_S} (bench/gpu_multigpu_jobs.sh: "
                   "`timeout 120`, --timeout 100). A SIGTERM or SIGINT to the driver does "
                   "the same at once")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    # The trainer's role (torchrun runs this file again with these).
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    p.add_argument("--marker-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trainer:  # torchrun's world; no --nproc (torchrun refuses it as ambiguous)
        return a
    if a.victim is None:
        a.victim = a.nproc - 1
    if a.commit_delay_ms is None:
        a.commit_delay_ms = 1000 if a.kill_at == "commit" else 1
    found = problems(a)
    if found:
        p.error("\n  ".join(["refused, nothing started:", *found]))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.trainer:
        from mid_step_kill.trainer import train_and_kill
        train_and_kill(a)
        return 0
    from mid_step_kill.driver import drive
    return drive(a, __file__)


if __name__ == "__main__":
    sys.exit(main())
