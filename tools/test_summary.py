"""Counts test cases from a Bazel build-event JSON file and its test.xml files.

Prints one line "N passed, N failed, N skipped" and exits non-zero when any
test failed or a target did not report (e.g. it did not build).
"""
import json
import os
import re
import sys
import urllib.parse
import xml.etree.ElementTree as ET


def count_xml(path):
    """Returns (passed, failed, skipped) from a JUnit XML file, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    passed = failed = skipped = 0
    cases = list(root.iter("testcase"))
    if not cases:
        return None
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None or case.get("result") == "skipped" \
                or case.get("status") == "notrun":
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def count_unittest_log(xml_path):
    """(passed, failed, skipped) from a Python unittest log beside test.xml.

    Bazel writes a one-case test.xml for tests that do not write their own;
    unittest's closing lines ("Ran N tests", "OK (skipped=K)" or
    "FAILED (failures=F, errors=E)") give the real counts."""
    log = os.path.join(os.path.dirname(xml_path), "test.log")
    try:
        text = open(log, errors="replace").read()
    except OSError:
        return None
    ran = re.findall(r"^Ran (\d+) tests? in", text, re.M)
    if not ran:
        # Script-style GPU tests print "SKIP: <why>" and exit 0 without a device.
        if re.search(r"^SKIP: ", text, re.M):
            return 0, 0, 1
        return None
    total = int(ran[-1])
    tail = text[text.rfind("Ran "):]
    failed = sum(int(x) for x in re.findall(r"(?:failures|errors)=(\d+)", tail))
    skipped = sum(int(x) for x in re.findall(r"skipped=(\d+)", tail))
    return total - failed - skipped, failed, skipped


def built(event):
    """Whether a targetCompleted event says the target built.

    Bazel marks a target that did not build either as aborted or as
    completed without `success` (a failed compile: `failureDetail`)."""
    if "aborted" in event:
        return False
    return event.get("completed", {}).get("success", False)


def main(events_path):
    passed = failed = skipped = 0
    results = {}
    unbuilt = set()
    if not os.path.exists(events_path):
        # Setup or Bazel failed before any test ran (the log above says why).
        print(f"no test results: {events_path} was not written")
        print("0 passed, 1 failed, 0 skipped")
        return 1
    with open(events_path) as f:
        for line in f:
            event = json.loads(line)
            eid = event.get("id", {})
            if "testResult" in eid:
                label = eid["testResult"]["label"]
                payload = event.get("testResult", {})
                results[(label, eid["testResult"].get("shard", 0))] = payload
            elif "targetCompleted" in eid and not built(event):
                unbuilt.add(eid["targetCompleted"]["label"])
    tested = {label for label, _ in results}
    for label in sorted(unbuilt - tested):
        failed += 1
        print(f"did not build: {label}")
    for (label, _), payload in sorted(results.items()):
        status = payload.get("status", "FAILED")
        xml = None
        for out in payload.get("testActionOutput", []):
            if out.get("name") == "test.xml":
                xml = urllib.parse.urlparse(out["uri"]).path
        counts = (count_unittest_log(xml) or count_xml(xml)) if xml else None
        if status != "PASSED":
            print(f"FAILED: {label} ({status})")
        if counts is None or (status != "PASSED" and counts[1] == 0):
            if status == "PASSED":
                passed += 1
            else:
                failed += 1
            continue
        passed += counts[0]
        failed += counts[1]
        skipped += counts[2]
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
