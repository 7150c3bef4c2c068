"""Whether the kill landed inside the step before any rank could commit it,
proven from the daemons' own log times (the driver runs the job with TZ=UTC
and reads them back), not from the trainer having seen a line."""
from __future__ import annotations

import datetime
import re

from .shared import EXCHANGED, STARTED

# A daemon log line: absl's prefix (severity, date and time to the microsecond
# in the daemon's TZ, which the driver sets to UTC, thread, file:line).
LOG_LINE = re.compile(r"^[IWEF](\d{8} \d{2}:\d{2}:\d{2}\.\d{6}) +\d+ \S+\] (.*)$")
WINDOW = re.compile(r"waiting (\d+) ms before the commit vote")


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


