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
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
CHAR_GPT = os.path.join(ROOT, "examples", "char_gpt")
# What a daemon run with --testonly_commit_delay_ms logs (core/step/layer_sharded_muon.cc).
STARTED = "testonly_commit_delay_ms: step {step}: started"
EXCHANGED = "testonly_commit_delay_ms: step {step}: exchanges done (ok)"
# A daemon log line: absl's prefix (severity, date and time to the microsecond
# in the daemon's TZ, which the driver sets to UTC, thread, file:line).
LOG_LINE = re.compile(r"^[IWEF](\d{8} \d{2}:\d{2}:\d{2}\.\d{6}) +\d+ \S+\] (.*)$")
WINDOW = re.compile(r"waiting (\d+) ms before the commit vote")
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


# -- shared by both roles ----------------------------------------------------------
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


# -- the trainer (one torchrun rank) --------------------------------------------------
class TermNoted:
    """SIGTERM noted, not obeyed at once: the trainer finishes its check
    (see the module docstring), exiting at most TERM_GRACE_S after it."""

    def __init__(self):
        self.at = None
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, _frame):
        if self.at is None:
            self.at = time.time()
            timer = threading.Timer(TERM_GRACE_S, os._exit, (128 + signum,))
            timer.daemon = True
            timer.start()


def daemon_pid(job: str, rank: int) -> int | None:
    """The pid of this job's muond-daemon of `rank` (its command line)."""
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"--job_id={job}" in argv and f"--rank={rank}" in argv:
            return int(path.split("/")[2])
    return None


class LogWatch:
    """A daemon's log, read as it grows (lines name their step id, so the
    whole log is searched: a survivor may have logged before the victim
    started watching)."""

    def __init__(self, path: str):
        self.path, self.text, self.offset = path, "", 0

    def has(self, line: str) -> bool:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        self.text += data.decode(errors="replace")
        return line in self.text


class KillInsideStep:
    """Wraps the victim's client's Step (called inside opt.step()) to SIGKILL
    the victim's daemon in the middle of the step:

    commit:     the RPC goes out; while it is in flight the daemon's log is
                watched for EXCHANGED (its momentum, exchanges and NS of the
                step are done, the commit vote not yet taken); then the kill.
    collective: before the RPC goes out, every survivor's daemon log is
                watched for STARTED (they are inside the step, which cannot
                end without the victim's ballot: they wait in its first
                collective); then the kill, and the RPC (which fails).

    What it records is the trainer's side; the driver proves the landing
    from the daemons' own log timestamps (landing()).
    """

    def __init__(self, client, kill_at: str, log_dir: str, world: int, job: str, rank: int,
                 limit_s: float):
        self.client, self.kill_at, self.job, self.rank = client, kill_at, job, rank
        self.limit_s = limit_s
        log = lambda r: os.path.join(log_dir, f"muond-rank{r}.log")  # noqa: E731
        self.own = LogWatch(log(rank))
        self.survivors = {r: LogWatch(log(r)) for r in range(world) if r != rank}
        self.real_step = client.step
        # Looked up now, not in the window: a /proc scan takes milliseconds.
        self.pid = daemon_pid(job, rank)
        self.record: dict = {"killed": False, "kill_point": kill_at, "pid": self.pid}
        client.step = self.step  # the instance attribute shadows the method

    def kill(self, markers: list[str], future=None) -> None:
        seen = time.time()
        if self.pid is not None:
            # The reply comes after the commit: a done RPC means it committed.
            self.record["rpc_done_at_kill"] = None if future is None else future.done()
            os.kill(self.pid, signal.SIGKILL)
            # After kill() returns no thread of the daemon runs user code
            # again (SIGKILL is pending on all of them): an upper bound.
            self.record.update(killed=True, kill_at=time.time())
        self.record.update(markers_seen_at=seen, markers=markers)

    def step(self, job_id, step_id, *args, **kwargs):
        self.client.step = self.real_step
        self.record["step_id"] = step_id
        deadline = time.monotonic() + self.limit_s
        if self.kill_at == "collective":
            lines = {r: STARTED.format(step=step_id) for r in self.survivors}
            while time.monotonic() < deadline:
                if all(w.has(lines[r]) for r, w in self.survivors.items()):
                    # Logged just before the step's first collective: let
                    # them reach it.
                    time.sleep(0.2)
                    self.kill([f"rank {r}: {line}" for r, line in lines.items()])
                    break
                time.sleep(0.005)
            self.record["rpc_sent_at"] = time.time()
            return self.real_step(job_id, step_id, *args, **kwargs)
        future = self.client.step_future(job_id, step_id, *args, **kwargs)
        self.record["rpc_sent_at"] = time.time()
        line = EXCHANGED.format(step=step_id)
        while not future.done() and time.monotonic() < deadline:
            if self.own.has(line):
                self.kill([f"rank {self.rank}: {line}"], future)
                break
            time.sleep(0.005)
        self.record["step_done_before_kill"] = not self.record["killed"] and future.done()
        return future.result()


def describe_error(e: BaseException) -> dict:
    code = getattr(e, "code", None)
    return {"type": type(e).__name__, "message": str(e),
            "code": getattr(code, "name", None if code is None else str(code)),
            "reason": getattr(e, "reason", ""), "metadata": dict(getattr(e, "metadata", {}) or {})}


def snapshot(model, opt, with_state: bool) -> dict:
    """This rank's params (local shards), the shared buffers the daemon
    updates for DTensor params, and (with_state) its daemon's optimizer state
    as ExportState streams it."""
    from torch.distributed.tensor import DTensor
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params[name.removeprefix("module.")] = local.detach().cpu().clone()
    shared = {opt._param_names[id(p)]: pview.detach().cpu().clone()
              for p, pview, _ in opt._dtensors}
    out = {"params": params, "shared": shared}
    if with_state:
        step_id, state = opt.clients[0].export_state(opt.job_id, opt.client_id)
        out.update(state_step_id=step_id, state={k: v.detach().cpu().clone()
                                                 for k, v in state.items()})
    return out


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


def trainer_options(a, world: int):
    """train_dist (the module) and its options for this run, the layout rule
    checked as train_dist.py checks it (the driver checked it already)."""
    args = layout_args(a, world)
    import train_dist
    from options import check_layout
    check_layout(args, world)
    return train_dist, args


def train_and_kill(a) -> None:
    term = TermNoted()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    result: dict = {"rank": rank, "world": world, "victim": rank == a.victim,
                    "pid": os.getpid()}
    if a.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    train_dist, args = trainer_options(a, world)
    from model import CharGPT
    mesh = train_dist.build_mesh(args, world, device.type)
    torch.manual_seed(0)  # the same init on every rank
    model = CharGPT(VOCAB, CONTEXT, args.d_model, args.layers, args.heads,
                    megatron_tags=False).to(device)
    model = train_dist.apply_layout(model, args, mesh, device)
    opt = train_dist.build_optimizer(model, args)
    from options import dp_size
    local_batch = args.batch // dp_size(args, world)
    first = train_dist.data_rank(args, mesh, rank) * local_batch
    initial = snapshot(model, opt, with_state=False)["params"]
    data = torch.Generator().manual_seed(1)
    for step in range(1, a.steps + 2):
        tokens = torch.randint(VOCAB, (args.batch, CONTEXT + 1), generator=data)
        tokens = tokens[first:first + local_batch].to(device)
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        if step <= a.steps:
            opt.step()
            continue
        if device.type == "cuda":
            torch.cuda.synchronize()
        before = snapshot(model, opt, with_state=True)
        result["trained"] = differing(initial, before["params"]) != []
        hook = None
        if rank == a.victim:
            hook = KillInsideStep(opt.clients[0], a.kill_at, a.log_dir, world,
                                  os.environ["MUOND_JOB_ID"], rank, a.marker_timeout)
        result["step_called_at"] = time.time()
        try:
            opt.step()
            result["raised"] = False
        except Exception as e:  # noqa: BLE001 (the outcome under test, recorded)
            result["raised_at"] = time.time()
            result["raised"] = True
            result["error"] = describe_error(e)
        if hook is not None:
            result["kill"] = hook.record
        if device.type == "cuda":
            torch.cuda.synchronize()
        after = snapshot(model, opt, with_state=rank != a.victim)
        result["params_changed"] = differing(before["params"], after["params"])
        result["shared_changed"] = differing(before["shared"], after["shared"])
        result["num_params"], result["num_shared"] = len(before["params"]), len(before["shared"])
        result["num_state_entries"] = len(before["state"])
        result["state_step_id_before"] = before["state_step_id"]
        if rank != a.victim:
            result["state_changed"] = differing(before["state"], after["state"])
            result["state_step_id_after"] = after["state_step_id"]
            try:
                h = opt.clients[0].health(timeout=10)
                result["health"] = {"has_plan": h.has_plan, "engine_error": h.engine_error}
            except Exception as e:  # noqa: BLE001 (reported)
                result["health"] = {"error": str(e)}
    result["sigterm_at"] = term.at
    with open(os.path.join(a.dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f, indent=1)
    os.replace(os.path.join(a.dir, f"rank{rank}.json.tmp"),
               os.path.join(a.dir, f"rank{rank}.json"))
    opt.close()  # best effort (2 s per daemon): unregisters, frees the shm
    if device.type == "cuda":
        # NCCL's teardown may wait for peers still inside their failing
        # step (up to the comm timeout): the result is written, so leave.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------
def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def processes_naming(text: str) -> list[int]:
    pids = (int(p.split("/")[2]) for p in glob.glob("/proc/[0-9]*"))
    return [pid for pid in pids if pid != os.getpid() and text in "\0".join(cmdline(pid))]


def log_time(text: str, wanted: str) -> float | None:
    """The time (epoch seconds) of the first line of a daemon log whose
    message contains `wanted`; None when none does."""
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m and wanted in m.group(2):
            stamp = datetime.datetime.strptime(m.group(1), "%Y%m%d %H:%M:%S.%f")
            return stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
    return None


def landing(kill_at: str, kill: dict, victim: int, logs: dict[int, str]) -> tuple[bool, str]:
    """Whether the victim's SIGKILL (the time kill() returned, an upper bound
    on when it was sent) came before any rank could commit the step, from
    its daemons' own log lines (logs: rank -> its daemon's log), and why.

    commit: the victim's daemon logs EXCHANGED, then sleeps the window it
    names, then votes, then commits: a kill before that line's time plus the
    window came before its commit vote (and so before any rank's commit,
    which needs its ballot); its Step RPC must not have returned by then
    either (the reply follows the commit). collective: every survivor's
    daemon logged STARTED before the kill, and the victim's daemon never
    did (its Step RPC went out after the kill): no rank can commit a step
    one rank never began."""
    step = kill.get("step_id")
    if not kill.get("killed"):
        return False, (f"no kill (daemon pid {kill.get('pid')}; the step ended first: "
                       f"{kill.get('step_done_before_kill')})")
    at = kill["kill_at"]
    if kill_at == "commit":
        line = EXCHANGED.format(step=step)
        t = log_time(logs.get(victim, ""), line)
        window = WINDOW.search(logs.get(victim, "").split(line, 1)[-1].split("\n", 1)[0])
        if t is None or window is None:
            return False, f"rank {victim}'s daemon log has no line {line!r} naming its wait"
        wait_s = int(window.group(1)) / 1000
        after = at - t
        inside = 0 <= after < wait_s
        detail = (f"SIGKILL {after * 1e3:.1f} ms after rank {victim}'s daemon logged step "
                  f"{step}'s exchanges done, " + (
                      f"inside its {wait_s * 1e3:.0f} ms wait before the commit vote" if inside
                      else f"not inside its {wait_s * 1e3:.0f} ms wait before the commit vote "
                      "(it may have voted and committed)"))
        if kill.get("rpc_done_at_kill") is not False:
            detail += f"; its Step RPC had returned (committed): {kill.get('rpc_done_at_kill')}"
        return inside and kill.get("rpc_done_at_kill") is False, detail
    starts = {r: log_time(text, STARTED.format(step=step))
              for r, text in logs.items() if r != victim}
    missing = sorted(r for r, t in starts.items() if t is None or t >= at)
    own = log_time(logs.get(victim, ""), STARTED.format(step=step))
    rpc_after = kill.get("rpc_sent_at", 0) >= at
    ok = bool(starts) and not missing and own is None and rpc_after
    if missing:
        return False, f"ranks {missing}: no {STARTED.format(step=step)!r} logged before the kill"
    gaps = [round((at - t) * 1e3, 1) for t in starts.values()]
    detail = (f"SIGKILL {min(gaps)}-{max(gaps)} ms after every survivor's daemon logged step "
              f"{step} started; rank {victim}'s daemon " + (
                  "never started it (its Step RPC went out after the kill)" if own is None
                  and rpc_after else f"started it too (logged at {own}, RPC sent at "
                  f"{kill.get('rpc_sent_at')}, kill at {at})"))
    return ok, detail


class Checks:
    def __init__(self):
        self.items: list[dict] = []

    def add(self, name: str, ok: bool, detail: str = "", show: bool = False) -> None:
        """show: print the detail on ok too (a measurement worth seeing)."""
        self.items.append({"check": name, "ok": bool(ok), "detail": detail, "show": show})

    @property
    def passed(self) -> bool:
        return bool(self.items) and all(c["ok"] for c in self.items)


def evaluate(a, proc, ranks: dict, job: str, tmp: str, checks: Checks) -> None:
    world, victim = a.nproc, a.victim
    missing = [r for r in range(world) if r not in ranks]
    checks.add("every trainer wrote its result", not missing,
               f"missing ranks {missing}" if missing else "")
    v = ranks.get(victim, {})
    kill = v.get("kill", {})
    logs = {}
    for r in range(world):
        try:
            with open(os.path.join(tmp, "logs", f"muond-rank{r}.log"), errors="replace") as f:
                logs[r] = f.read()
        except OSError:
            logs[r] = ""
    ok, detail = landing(a.kill_at, kill, victim, logs)
    checks.add(f"the kill landed inside step {kill.get('step_id', a.steps + 1)}, before any "
               "rank could commit it (the daemons' log times)", ok, detail, show=True)
    err = v.get("error", {})
    checks.add(f"the victim's opt.step() raised naming its daemon",
               v.get("raised") and err.get("code") == "UNAVAILABLE"
               and f"muond-{job}-{victim}.sock" in err.get("message", ""),
               err.get("message", "")[:300])
    kill_at = kill.get("kill_at")
    for r in sorted(set(ranks) - {victim}):
        s = ranks[r]
        e = s.get("error", {})
        msg = e.get("message", "")
        took = s["raised_at"] - kill_at if s.get("raised") and kill_at else None
        checks.add(f"rank {r}: opt.step() raised PEER_GONE naming dead rank {victim}",
                   s.get("raised") and e.get("code") == "UNAVAILABLE"
                   and e.get("reason") == "PEER_GONE" and f"dead rank {victim}" in msg
                   and "a peer daemon is gone" in msg, msg[:400])
        checks.add(f"rank {r}: raised {took if took is None else round(took, 2)} s after the "
                   f"kill, not by the comm timeout ({a.comm_timeout_s} s)",
                   took is not None and "did not answer in time" not in msg
                   and took < a.comm_timeout_s / 2,
                   f"step called {round(kill_at - s['step_called_at'], 2)} s before the kill"
                   if kill_at and "step_called_at" in s else "")
        checks.add(f"rank {r}: trained before the kill step", s.get("trained"))
        checks.add(f"rank {r}: params ({s.get('num_params')}) and shared buffers "
                   f"({s.get('num_shared')}) bitwise unchanged by the failed step",
                   s.get("params_changed") == [] and s.get("shared_changed") == [],
                   f"changed: {s.get('params_changed')} {s.get('shared_changed')}")
        checks.add(f"rank {r}: optimizer state ({s.get('num_state_entries')} entries, step id "
                   f"{s.get('state_step_id_before')}) bitwise unchanged",
                   s.get("num_state_entries", 0) > 0 and s.get("state_changed") == []
                   and s.get("state_step_id_after") == s.get("state_step_id_before"),
                   f"changed: {s.get('state_changed')}, step id "
                   f"{s.get('state_step_id_before')} -> {s.get('state_step_id_after')}")
        h = s.get("health", {})
        checks.add(f"rank {r}: its daemon reports no plan and says to re-register",
                   h.get("has_plan") is False and "re-register" in h.get("engine_error", ""),
                   json.dumps(h)[:300])
    if v:
        checks.add(f"rank {victim} (victim): params bitwise unchanged (its daemon died before "
                   "any commit)",
                   v.get("params_changed") == [] and v.get("shared_changed") == [],
                   f"changed: {v.get('params_changed')} {v.get('shared_changed')}")
    want = (f"FAILED: daemon rank {victim} (pid {kill.get('pid')}) killed by signal 9 "
            "(SIGKILL)")
    checks.add("muond launch exited 1 naming the dead daemon",
               proc.returncode == 1 and want in proc.stderr,
               f"rc {proc.returncode}; wanted {want!r}")
    left = {"processes": [" ".join(cmdline(p))[:200] for p in
                          sorted(set(processes_naming(job) + processes_naming(tmp)))],
            "socket_dirs": glob.glob(f"/tmp/muond-{job}-*"),
            "shm": glob.glob(f"/dev/shm/muond-{job}-*")}
    checks.add("nothing left (processes, socket dirs, shm objects)",
               not any(left.values()), json.dumps(left)[:500])


class Stopped(Exception):
    """The driver got SIGTERM or SIGINT (a caller's `timeout`, ^C)."""


def stop_everything(launch: subprocess.Popen, job: str, tmp: str) -> None:
    """A run that did not end by itself (--timeout, a stop signal): SIGKILL
    the launcher and everything naming the job or the run's directory (the
    launcher's servers and torchrun with its trainers, each in its own
    session), until none is left (10 s at most), then the job's socket dirs
    and shm objects the launcher had no chance to remove. No grace: a run
    cut short is a FAIL anyway, and a caller's cap leaves CLEANUP_S."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = set(processes_naming(job) + processes_naming(tmp))
        if launch.poll() is None:
            pids.add(launch.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launch.poll()
        time.sleep(0.1)
    remove_leftovers(job)


def remove_leftovers(job: str) -> None:
    """This job's socket dirs and shm objects (its name is this run's own)."""
    for path in glob.glob(f"/tmp/muond-{job}-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(f"/dev/shm/muond-{job}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def drive(a) -> int:
    import muond
    tmp = tempfile.mkdtemp(prefix="kms-", dir="/tmp")
    job = f"kms{os.getpid()}-{uuid.uuid4().hex[:6]}"
    logs = os.path.join(tmp, "logs")
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
    # TZ=UTC: the daemons' log times are read back as UTC (landing()).
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TZ="UTC",
               PYTHONPATH=os.pathsep.join(
                   [pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
                "MUOND_DAEMON", "MUOND_SOCKET_DIR"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "muond.cli", "launch", "--nproc-per-node", str(a.nproc),
            "--device", a.device, "--job-id", job, "--log-dir", logs,
            "--stop-grace", str(TERM_GRACE_S + 30),
            f"--daemon-arg=--testonly_commit_delay_ms={a.commit_delay_ms}",
            f"--daemon-arg=--comm_timeout_s={a.comm_timeout_s}"]
    if a.bin_dir:
        argv += ["--bin-dir", a.bin_dir]
    argv += ["--", sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(a.nproc), os.path.abspath(__file__), "--trainer",
             "--dir", tmp, "--log-dir", logs, "--parallel", a.parallel, "--inner", str(a.inner),
             "--steps", str(a.steps), "--victim", str(a.victim), "--kill-at", a.kill_at,
             "--device", a.device, "--marker-timeout", str(a.comm_timeout_s)]
    print(f"kill_mid_step: {a.parallel} on {a.nproc} ranks ({a.device}), {a.steps} steps, then "
          f"rank {a.victim}'s daemon SIGKILLed inside step {a.steps + 1} (--kill-at "
          f"{a.kill_at}); job {job}, dir {tmp}", flush=True)

    def on_signal(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    cut_short = ""
    # The launcher's output in files: kept whole whatever ends the run.
    out_path, err_path = os.path.join(tmp, "launch.out"), os.path.join(tmp, "launch.err")
    launch = None
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            launch = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                      env=env, start_new_session=True)
            launch.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        cut_short = f"muond launch still running after --timeout {a.timeout:g} s"
    except Stopped as e:
        cut_short = f"the driver got {e} after {time.monotonic() - t0:.1f} s"
    # From here on a stop signal waits: the cleanup and the JSON come first
    # (seconds; a caller's cap leaves CLEANUP_S).
    for sig in handlers:
        signal.signal(sig, signal.SIG_IGN)
    if cut_short:
        print(f"kill_mid_step: {cut_short}; stopping the job", flush=True)
    wall = time.monotonic() - t0
    try:
        with open(err_path, errors="replace") as f:
            stderr = f.read()
    except OSError:
        stderr = ""
    rc = launch.poll() if launch is not None else None
    proc = subprocess.CompletedProcess(argv, -1 if cut_short or rc is None else rc, "", stderr)
    ranks = {}
    for r in range(a.nproc):
        try:
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks[r] = json.load(f)
        except (OSError, ValueError):
            pass
    checks = Checks()
    if cut_short:
        checks.add(f"muond launch ended by itself within --timeout {a.timeout:g} s", False,
                   cut_short)
    evaluate(a, proc, ranks, job, tmp, checks)
    # Whatever is left (the check above said so): a failed run's.
    if launch is not None:
        stop_everything(launch, job, tmp)
    for c in checks.items:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}"
              + (f"\n       {c['detail']}" if c["detail"] and (not c["ok"] or c["show"])
                 else ""))
    verdict = "PASS" if checks.passed else "FAIL"
    print(f"kill_mid_step: {verdict} ({sum(c['ok'] for c in checks.items)}/{len(checks.items)} "
          f"checks, {wall:.1f} s)", flush=True)
    if not checks.passed:
        print("--- muond launch stderr (last 4000 chars) ---\n" + proc.stderr[-4000:])
        for log in sorted(glob.glob(os.path.join(logs, "*.log"))):
            with open(log, errors="replace") as f:
                print(f"--- {os.path.basename(log)} (last 1500 chars) ---\n" + f.read()[-1500:])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"verdict": verdict, "layout": a.parallel, "nproc": a.nproc,
                       "device": a.device, "victim": a.victim, "steps_before": a.steps,
                       "kill_at": a.kill_at,
                       "commit_delay_ms": a.commit_delay_ms, "comm_timeout_s": a.comm_timeout_s,
                       "timeout_s": a.timeout, "cut_short": cut_short,
                       "job": job, "wall_s": wall, "launch_rc": proc.returncode,
                       "launch_stderr_tail": proc.stderr[-3000:], "checks": checks.items,
                       "ranks": ranks}, f, indent=1)
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()
    return 0 if checks.passed else 1


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
        train_and_kill(a)
        return 0
    return drive(a)


if __name__ == "__main__":
    sys.exit(main())
