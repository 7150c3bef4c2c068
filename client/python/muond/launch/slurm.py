"""Slurm's compressed host lists (``gpu[001-004,010],login1``) and per-node
task counts (``4(x3)``), read for the launcher's layout; LaunchError names
the variable and the rule. A host list is checked and counted without being
expanded, so a huge list is refused early instead of built."""
from __future__ import annotations

import re

from muond.launch.errors import LaunchError

# Hosts in $SLURM_JOB_NODELIST: more than any Slurm cluster has; only the
# first host is ever built (the bound stops r[0-99999]n[0-99999] early).
MAX_NODELIST_HOSTS = 100000


def slurm_tasks_per_node(text: str) -> int:
    """$SLURM_NTASKS_PER_NODE / $SLURM_TASKS_PER_NODE: "4", "4(x3)" or a
    list ("4(x2),4") of equal counts; a launcher needs one count per node."""
    counts = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x\d+\))?", part.strip())
        if not m:
            raise LaunchError(f"$SLURM_NTASKS_PER_NODE={text!r}: expected N or N(xM) items")
        counts.add(int(m.group(1)))
    if len(counts) != 1:
        raise LaunchError(f"$SLURM_NTASKS_PER_NODE={text!r}: nodes run different task counts; "
                          "muond launch needs the same count on every node (pass "
                          "--nproc-per-node)")
    return counts.pop()


def _parse_nodelist(text: str, source: str) -> list:
    """Items of a compressed host list as [literal, ranges, literal, ...]
    segments (ranges: [(lo, hi)] digit strings), checked and counted without
    expanding: LaunchError when malformed or over MAX_NODELIST_HOSTS."""
    items, total = [], 0
    for item in _split_top_level(text, source):
        segments, pos, count = [], 0, 1
        for m in re.finditer(r"\[([^\[\]]*)\]", item):
            ranges = _parse_ranges(m.group(1), source)
            segments += [item[pos:m.start()], ranges]
            count *= sum(int(hi) - int(lo) + 1 for lo, hi in ranges)
            pos = m.end()
            if count > MAX_NODELIST_HOSTS:
                break
        segments.append(item[pos:])
        total += count
        if total > MAX_NODELIST_HOSTS:
            raise LaunchError(f"{source}={text[:80]!r}{'...' if len(text) > 80 else ''} "
                              f"names more than {MAX_NODELIST_HOSTS} hosts (bracket groups "
                              "multiply); a job's node list is at most that")
        items.append(segments)
    return items


def first_host(text: str, source: str = "$SLURM_JOB_NODELIST") -> str:
    """The first host of Slurm's compressed host list, built alone (the list
    is checked and counted, never expanded)."""
    segments = _parse_nodelist(text, source)[0]
    return "".join(s if isinstance(s, str) else s[0][0] for s in segments)


def expand_nodelist(text: str, source: str = "$SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compressed host list expanded, in order: ``gpu[001-003,7],b1``
    -> gpu001 gpu002 gpu003 gpu7 b1 (a range keeps its start's zero padding;
    several bracket groups in one name multiply: ``r[1-2]n[1-2]`` -> r1n1
    r1n2 r2n1 r2n2). At most MAX_NODELIST_HOSTS hosts."""
    hosts: list[str] = []
    for segments in _parse_nodelist(text, source):
        names = [""]
        for s in segments:
            values = [s] if isinstance(s, str) else [
                str(i).zfill(len(lo)) for lo, hi in s for i in range(int(lo), int(hi) + 1)]
            names = [n + v for n in names for v in values]
        hosts.extend(names)
    return hosts


def _split_top_level(text: str, source: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"{source}={text!r}: nested brackets")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"{source}={text!r}: ']' without '['")
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"{source}={text!r}: '[' without ']'")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise LaunchError(f"{source}={text!r}: an empty host name")
    return [item.strip() for item in items]


def _parse_ranges(spec: str, source: str) -> list:
    """"001-003,7" -> [("001", "003"), ("7", "7")]."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise LaunchError(f"{source}: [{spec[:40]}]: {part[:40]!r} is not N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"{source}: [{spec[:40]}]: range {part!r} runs backwards")
        out.append((lo, hi))
    return out
