"""The driver's role: runs the job through `muond launch` (torchrun running
kill_mid_step.py --trainer on every rank), bounded by --timeout and a stop
signal, then checks it, prints the summary and writes --out's JSON."""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from .processes import stop_everything
from .report import Checks, evaluate
from .shared import TERM_GRACE_S

# What the launcher must not inherit from a caller that is itself a trainer.
LAUNCH_ENV_DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
                      "MUOND_DAEMON", "MUOND_SOCKET_DIR")


class Stopped(Exception):
    """The driver got SIGTERM or SIGINT (a caller's `timeout`, ^C)."""


def launch_env() -> dict:
    """The launcher's environment: this muond on PYTHONPATH and TZ=UTC, since
    the daemons' log times are read back as UTC (landing())."""
    import muond
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TZ="UTC",
               PYTHONPATH=os.pathsep.join(
                   [pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key in LAUNCH_ENV_DROPPED:
        env.pop(key, None)
    return env


def launch_argv(a, script: str, job: str, tmp: str, logs: str) -> list[str]:
    """`muond launch ... -- torchrun ... script --trainer ...` for options a."""
    argv = [sys.executable, "-m", "muond.cli", "launch", "--nproc-per-node", str(a.nproc),
            "--device", a.device, "--job-id", job, "--log-dir", logs,
            "--stop-grace", str(TERM_GRACE_S + 30),
            f"--daemon-arg=--testonly_commit_delay_ms={a.commit_delay_ms}",
            f"--daemon-arg=--comm_timeout_s={a.comm_timeout_s}"]
    if a.bin_dir:
        argv += ["--bin-dir", a.bin_dir]
    argv += ["--", sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(a.nproc), script, "--trainer",
             "--dir", tmp, "--log-dir", logs, "--parallel", a.parallel, "--inner", str(a.inner),
             "--steps", str(a.steps), "--victim", str(a.victim), "--kill-at", a.kill_at,
             "--device", a.device, "--marker-timeout", str(a.comm_timeout_s)]
    return argv


def run_launch(argv: list[str], env: dict, timeout: float, tmp: str):
    """Runs the launcher, its output kept whole in files under tmp whatever
    ends the run. Returns (the Popen or None, why the run was cut short or
    ""). From its return on a stop signal is ignored: the cleanup and the
    JSON come first (seconds; a caller's cap leaves CLEANUP_S)."""

    def on_signal(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    cut_short = ""
    launch = None
    try:
        with open(os.path.join(tmp, "launch.out"), "w") as out, \
                open(os.path.join(tmp, "launch.err"), "w") as err:
            launch = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                      env=env, start_new_session=True)
            launch.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        cut_short = f"muond launch still running after --timeout {timeout:g} s"
    except Stopped as e:
        cut_short = f"the driver got {e} after {time.monotonic() - t0:.1f} s"
    for sig in handlers:
        signal.signal(sig, signal.SIG_IGN)
    return launch, cut_short


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def read_ranks(tmp: str, world: int) -> dict:
    """rank -> the result its trainer wrote (ranks that wrote none left out)."""
    ranks = {}
    for r in range(world):
        try:
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return ranks


def print_summary(checks: Checks, wall: float, stderr: str, logs: str) -> str:
    """Prints one line per check and the verdict (on a FAIL also the tails of
    the launcher's stderr and of every log); returns the verdict."""
    for c in checks.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}"
              + (f"\n       {c['detail']}" if c["detail"] and (not c["ok"] or c["show"])
                 else ""))
    verdict = "PASS" if checks.passed else "FAIL"
    print(f"kill_mid_step: {verdict} ({sum(c['ok'] for c in checks.items)}/{len(checks.items)} "
          f"checks, {wall:.1f} s)", flush=True)
    if not checks.passed:
        print("--- muond launch stderr (last 4000 chars) ---\n" + stderr[-4000:])
        for log in sorted(glob.glob(os.path.join(logs, "*.log"))):
            print(f"--- {os.path.basename(log)} (last 1500 chars) ---\n" + read_text(log)[-1500:])
    return verdict


def write_result(path: str, a, verdict: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump({"verdict": verdict, "layout": a.parallel, "nproc": a.nproc, "device": a.device,
                   "victim": a.victim, "steps_before": a.steps, "kill_at": a.kill_at,
                   "commit_delay_ms": a.commit_delay_ms, "comm_timeout_s": a.comm_timeout_s,
                   "timeout_s": a.timeout, **result}, f, indent=1)


def drive(a, script: str) -> int:
    """Runs the job (script: kill_mid_step.py, which torchrun runs as each
    trainer) and checks it; 0 when every check passed."""
    tmp = tempfile.mkdtemp(prefix="kms-", dir="/tmp")
    job = f"kms{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs = os.path.join(tmp, "logs")
    argv = launch_argv(a, os.path.abspath(script), job, tmp, logs)
    print(f"kill_mid_step: {a.parallel} on {a.nproc} ranks ({a.device}), {a.steps} steps, then "
          f"rank {a.victim}'s daemon SIGKILLed inside step {a.steps + 1} (--kill-at "
          f"{a.kill_at}); job {job}, dir {tmp}", flush=True)
    t0 = time.monotonic()
    launch, cut_short = run_launch(argv, launch_env(), a.timeout, tmp)
    if cut_short:
        print(f"kill_mid_step: {cut_short}; stopping the job", flush=True)
    wall = time.monotonic() - t0
    stderr = read_text(os.path.join(tmp, "launch.err"))
    rc = launch.poll() if launch is not None else None
    proc = subprocess.CompletedProcess(argv, -1 if cut_short or rc is None else rc, "", stderr)
    ranks = read_ranks(tmp, a.nproc)
    checks = Checks()
    if cut_short:
        checks.add(f"muond launch ended by itself within --timeout {a.timeout:g} s", False,
                   cut_short)
    evaluate(a, proc, ranks, job, tmp, checks)
    # Whatever is left (the check above said so): a failed run's.
    if launch is not None:
        stop_everything(launch, job, tmp)
    verdict = print_summary(checks, wall, proc.stderr, logs)
    if a.out:
        write_result(a.out, a, verdict, {"cut_short": cut_short, "job": job,
                                "wall_s": wall, "launch_rc": proc.returncode,
                                "launch_stderr_tail": proc.stderr[-3000:],
                                "checks": checks.items, "ranks": ranks})
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()
    return 0 if checks.passed else 1
