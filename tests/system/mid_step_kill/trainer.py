"""The trainer's role (one torchrun rank): trains the small CharGPT, then
snapshots params and optimizer state around the kill step, the victim's
rank SIGKILLing its own daemon from inside opt.step(), and writes what it
saw to <dir>/rank<R>.json for the driver's checks."""
from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time

from .shared import (CONTEXT, EXCHANGED, STARTED, TERM_GRACE_S, VOCAB, differing,
                     layout_args)


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

def trainer_options(a, world: int):
    """train_dist (the module) and its options for this run, the layout rule
    checked as train_dist.py checks it (the driver checked it already)."""
    args = layout_args(a, world)
    import train_dist
    from options import check_layout
    check_layout(args, world)
    return train_dist, args


def start_rank(a):
    """This rank's torch device and process group (gloo on CPU, NCCL on CUDA)."""
    import torch
    import torch.distributed as dist
    if a.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def build_job(a, world: int, rank: int, device):
    """The CharGPT laid out as train_dist.py lays it out, its muond.torch.Muon,
    and a function that runs forward and backward on this rank's slice of
    the step's batch (the same random tokens on every rank)."""
    import torch
    import torch.nn.functional as F
    train_dist, args = trainer_options(a, world)
    from model import CharGPT
    from options import dp_size
    mesh = train_dist.build_mesh(args, world, device.type)
    torch.manual_seed(0)  # the same init on every rank
    model = CharGPT(VOCAB, CONTEXT, args.d_model, args.layers, args.heads,
                    megatron_tags=False).to(device)
    model = train_dist.apply_layout(model, args, mesh, device)
    opt = train_dist.build_optimizer(model, args)
    local_batch = args.batch // dp_size(args, world)
    first = train_dist.data_rank(args, mesh, rank) * local_batch
    data = torch.Generator().manual_seed(1)

    def forward_backward():
        tokens = torch.randint(VOCAB, (args.batch, CONTEXT + 1), generator=data)
        tokens = tokens[first:first + local_batch].to(device)
        opt.zero_grad()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()

    return model, opt, forward_backward


def synchronize(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()


def step_recorded(opt, result: dict) -> None:
    """opt.step(), its outcome (raised or not, when, the error) in result."""
    result["step_called_at"] = time.time()
    try:
        opt.step()
        result["raised"] = False
    except Exception as e:  # noqa: BLE001 (the outcome under test, recorded)
        result["raised_at"] = time.time()
        result["raised"] = True
        result["error"] = describe_error(e)


def compare_snapshots(before: dict, after: dict, survivor: bool, result: dict) -> None:
    """What the failed step changed (nothing, if it holds)."""
    result["params_changed"] = differing(before["params"], after["params"])
    result["shared_changed"] = differing(before["shared"], after["shared"])
    result["num_params"], result["num_shared"] = len(before["params"]), len(before["shared"])
    result["num_state_entries"] = len(before["state"])
    result["state_step_id_before"] = before["state_step_id"]
    if survivor:
        result["state_changed"] = differing(before["state"], after["state"])
        result["state_step_id_after"] = after["state_step_id"]


def record_health(opt, result: dict) -> None:
    try:
        h = opt.clients[0].health(timeout=10)
        result["health"] = {"has_plan": h.has_plan, "engine_error": h.engine_error}
    except Exception as e:  # noqa: BLE001 (reported)
        result["health"] = {"error": str(e)}


def kill_step(a, model, opt, device, initial: dict, rank: int, world: int,
              result: dict) -> None:
    """The kill step: snapshots around opt.step(), the victim's daemon
    SIGKILLed inside it (KillInsideStep), and what each rank saw (initial:
    the params before training, to show the job trained)."""
    synchronize(device)
    before = snapshot(model, opt, with_state=True)
    result["trained"] = differing(initial, before["params"]) != []
    hook = None
    if rank == a.victim:
        hook = KillInsideStep(opt.clients[0], a.kill_at, a.log_dir, world,
                              os.environ["MUOND_JOB_ID"], rank, a.marker_timeout)
    step_recorded(opt, result)
    if hook is not None:
        result["kill"] = hook.record
    synchronize(device)
    survivor = rank != a.victim
    after = snapshot(model, opt, with_state=survivor)
    compare_snapshots(before, after, survivor, result)
    if survivor:
        record_health(opt, result)


def write_rank_result(directory: str, rank: int, result: dict) -> None:
    """<directory>/rank<R>.json, whole or not at all (written, then renamed)."""
    path = os.path.join(directory, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def train_and_kill(a) -> None:
    term = TermNoted()
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result: dict = {"rank": rank, "world": world, "victim": rank == a.victim,
                    "pid": os.getpid()}
    device = start_rank(a)
    model, opt, forward_backward = build_job(a, world, rank, device)
    initial = snapshot(model, opt, with_state=False)["params"]
    for _ in range(a.steps):
        forward_backward()
        opt.step()
    forward_backward()
    kill_step(a, model, opt, device, initial, rank, world, result)
    result["sigterm_at"] = term.at
    write_rank_result(a.dir, rank, result)
    opt.close()  # best effort (2 s per daemon): unregisters, frees the shm
    if device.type == "cuda":
        # NCCL's teardown may wait for peers still inside their failing
        # step (up to the comm timeout): the result is written, so leave.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
