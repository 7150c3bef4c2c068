#!/usr/bin/env python3
"""The after ÷ before table of an A B B A run of bench/gpu_step_bench.py.

Each argument is one run's `--out` markdown, named `<A|B>-<anything>.md`; A is
the build before, B the build after. Per step set (a `### ` section of the
file) the first table's round rows give that run's milliseconds; the report
shows every run in the order given, the means of A and of B, and B ÷ A (below
1: B is faster).

    python3 bench/ab_steps_report.py A-1.md B-2.md B-3.md A-4.md
"""
import os
import re
import sys


def read_run(path):
    """{set title: [ms of each round]} of one gpu_step_bench.py --out file; {} when
    the file is missing (a run that failed before writing it)."""
    if not os.path.exists(path):
        return {}
    sets, title, rows = {}, None, None
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if line.startswith("### "):
            title = line[4:].split(":")[0].strip()
            rows = None
            continue
        if title is None or title in sets:
            continue
        if rows is None and line.startswith("| round |"):
            rows = []
            continue
        if rows is not None:
            m = re.match(r"^\| (\d+) \| ([0-9.]+) \|", line)
            if m:
                rows.append(float(m.group(2)))
            elif line.startswith("|---"):
                continue
            else:
                sets[title] = rows
                rows = None
    if title is not None and rows:
        sets.setdefault(title, rows)
    return sets


def build_of(path):
    """'A' or 'B' from the file's name."""
    name = os.path.basename(path)
    if name[:2] not in ("A-", "B-"):
        raise SystemExit(f"{path}: the name must start with A- or B-")
    return name[0]


def report(paths):
    runs = [(build_of(p), read_run(p)) for p in paths]
    titles = []
    for _, sets in runs:
        titles += [t for t in sets if t not in titles]
    head = " | ".join(f"{who} ({i + 1})" for i, (who, _) in enumerate(runs))
    lines = [f"| set | {head} | mean A | mean B | B ÷ A |",
             "|---|" + "---|" * (len(runs) + 3)]
    for title in titles:
        cells, by = [], {"A": [], "B": []}
        for who, sets in runs:
            ms = sets.get(title, [])
            cells.append(" / ".join(f"{v:.2f}" for v in ms) if ms else "-")
            by[who] += ms
        if not by["A"] or not by["B"]:
            continue
        a, b = sum(by["A"]) / len(by["A"]), sum(by["B"]) / len(by["B"])
        lines.append(f"| {title} | {' | '.join(cells)} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print(report(sys.argv[1:]))
