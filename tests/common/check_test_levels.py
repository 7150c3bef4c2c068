#!/usr/bin/env python3
"""Checks that every test target carries exactly one level tag.

The levels (tests/README.md): "unit" (in-process, fast, no subprocess
servers), "integration" (real binaries/servers or several processes on one
machine), "system" (whole jobs: launcher, torchrun, several nodes, kill
tests) and "gpu" (needs a CUDA device, skips cleanly without one).
`deploy/test.sh --quick` runs the unit level alone, so a test without a level
would silently never run there, and one with two would run at the wrong level.

Usage (from the repository root; deploy/test.sh runs it first):
  tests/common/check_test_levels.py [SCOPE]      default SCOPE: //tests/...
Queries Bazel (`bazel query ... --output=xml`; $BAZEL names another bazel) and
prints each offender with the level tags it has; exits 1 if there is one.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

LEVELS = ("unit", "integration", "system", "gpu")


def test_tags(query_xml: str) -> dict[str, list[str]]:
    """{label: tags} of every *_test rule in `bazel query --output=xml` text."""
    tags = {}
    for rule in ET.fromstring(query_xml).iter("rule"):
        if not rule.get("class", "").endswith("_test"):
            continue
        values = []
        for attr in rule.findall("list"):
            if attr.get("name") == "tags":
                values = [s.get("value") for s in attr.findall("string")]
        tags[rule.get("name")] = values
    return tags


def offenders(tags: dict[str, list[str]]) -> list[str]:
    """One line per label whose tags hold no level or more than one."""
    lines = []
    for label, values in sorted(tags.items()):
        levels = [t for t in values if t in LEVELS]
        if len(levels) != 1:
            have = ", ".join(levels) if levels else "none"
            lines.append(f"{label}: level tags {have}")
    return lines


def query(scope: str) -> str:
    bazel = os.environ.get("BAZEL", "bazel")
    return subprocess.run(
        [bazel, "query", "--noshow_progress", f'kind(".*_test rule", {scope})',
         "--output=xml"],
        check=True, stdout=subprocess.PIPE, text=True).stdout


def main(argv: list[str]) -> int:
    scope = argv[1] if len(argv) > 1 else "//tests/..."
    tags = test_tags(query(scope))
    bad = offenders(tags)
    if bad:
        print(f"{len(bad)} of {len(tags)} test targets under {scope} need exactly one "
              f"level tag of {', '.join(LEVELS)} (tests/README.md \"Levels\"):")
        for line in bad:
            print("  " + line)
        return 1
    print(f"test levels: all {len(tags)} test targets under {scope} carry one level tag")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
