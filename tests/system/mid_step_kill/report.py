"""The driver's checks of a finished run (each a line of the summary, all in
--out's JSON), from the trainers' results, the daemons' logs, the
launcher's exit and what is left on the machine."""
from __future__ import annotations

import glob
import json
import os

from .landing import landing
from .processes import cmdline, processes_naming


class Checks:
    """The run's checks in order: name, verdict, detail."""

    def __init__(self):
        self.items: list[dict] = []

    def add(self, name: str, ok: bool, detail: str = "", show: bool = False) -> None:
        """show: print the detail on ok too (a measurement worth seeing)."""
        self.items.append({"check": name, "ok": bool(ok), "detail": detail, "show": show})

    @property
    def passed(self) -> bool:
        return bool(self.items) and all(c["ok"] for c in self.items)


def read_daemon_logs(tmp: str, world: int) -> dict[int, str]:
    """rank -> its daemon's log ("" when there is none)."""
    logs = {}
    for r in range(world):
        try:
            with open(os.path.join(tmp, "logs", f"muond-rank{r}.log"), errors="replace") as f:
                logs[r] = f.read()
        except OSError:
            logs[r] = ""
    return logs


def check_survivor(a, r: int, s: dict, kill_at: float | None, checks: Checks) -> None:
    """Survivor r failed fast naming the dead rank, with nothing applied."""
    victim = a.victim
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


def check_nothing_left(job: str, tmp: str, checks: Checks) -> None:
    """No process naming the job or the run's directory, no socket dir, no shm."""
    left = {"processes": [" ".join(cmdline(p))[:200] for p in
                          sorted(set(processes_naming(job) + processes_naming(tmp)))],
            "socket_dirs": glob.glob(f"/tmp/muond-{job}-*"),
            "shm": glob.glob(f"/dev/shm/muond-{job}-*")}
    checks.add("nothing left (processes, socket dirs, shm objects)",
               not any(left.values()), json.dumps(left)[:500])


def evaluate(a, proc, ranks: dict, job: str, tmp: str, checks: Checks) -> None:
    """Every check of the run, in the summary's order."""
    world, victim = a.nproc, a.victim
    missing = [r for r in range(world) if r not in ranks]
    checks.add("every trainer wrote its result", not missing,
               f"missing ranks {missing}" if missing else "")
    v = ranks.get(victim, {})
    kill = v.get("kill", {})
    ok, detail = landing(a.kill_at, kill, victim, read_daemon_logs(tmp, world))
    checks.add(f"the kill landed inside step {kill.get('step_id', a.steps + 1)}, before any "
               "rank could commit it (the daemons' log times)", ok, detail, show=True)
    err = v.get("error", {})
    checks.add("the victim's opt.step() raised naming its daemon",
               v.get("raised") and err.get("code") == "UNAVAILABLE"
               and f"muond-{job}-{victim}.sock" in err.get("message", ""),
               err.get("message", "")[:300])
    for r in sorted(set(ranks) - {victim}):
        check_survivor(a, r, ranks[r], kill.get("kill_at"), checks)
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
    check_nothing_left(job, tmp, checks)
