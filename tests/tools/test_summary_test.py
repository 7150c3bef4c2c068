"""tools/test_summary.py counts cases and fails on targets that did not build."""
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout
from io import StringIO

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tools import test_summary  # noqa: E402

JUNIT = """<?xml version="1.0"?>
<testsuites><testsuite>
<testcase name="a"/><testcase name="b"><failure/></testcase>
<testcase name="c"><skipped/></testcase>
</testsuite></testsuites>"""


class TestSummaryTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.xml = os.path.join(self.dir, "test.xml")
        with open(self.xml, "w") as f:
            f.write(JUNIT)

    def summarize(self, events):
        path = os.path.join(self.dir, "events.json")
        with open(path, "w") as f:
            for event in events:
                f.write(json.dumps(event) + "\n")
        out = StringIO()
        with redirect_stdout(out):
            rc = test_summary.main(path)
        return rc, out.getvalue().splitlines()

    def result_event(self, label, status):
        return {"id": {"testResult": {"label": label, "shard": 0}},
                "testResult": {"status": status, "testActionOutput": [
                    {"name": "test.xml", "uri": "file://" + self.xml}]}}

    @staticmethod
    def completed_event(label, completed):
        return {"id": {"targetCompleted": {"label": label}},
                "completed": completed}

    def test_counts_cases_of_a_report(self):
        rc, lines = self.summarize(
            [self.completed_event("//t:a", {"success": True}),
             self.result_event("//t:a", "FAILED")])
        self.assertEqual((rc, lines[-1]), (1, "1 passed, 1 failed, 1 skipped"))

    def test_compile_failure_counts_as_failed(self):
        # A failed compile is "completed" without success, not "aborted".
        events = [self.completed_event("//t:ok", {"success": True}),
                  self.completed_event("//t:broken",
                                 {"failureDetail": {"message": "gcc failed"}})]
        rc, lines = self.summarize(events)
        self.assertEqual(rc, 1)
        self.assertIn("did not build: //t:broken", lines)
        self.assertEqual(lines[-1], "0 passed, 1 failed, 0 skipped")

    def test_aborted_target_counts_as_failed(self):
        events = [{"id": {"targetCompleted": {"label": "//t:x"}},
                   "aborted": {"reason": "SKIPPED"}}]
        self.assertEqual(self.summarize(events)[0], 1)

    def test_all_built_and_passed_exits_zero(self):
        with open(self.xml, "w") as f:
            f.write('<testsuites><testsuite><testcase name="a"/>'
                    '</testsuite></testsuites>')
        events = [self.completed_event("//t:a", {"success": True}),
                  self.result_event("//t:a", "PASSED")]
        self.assertEqual(self.summarize(events),
                         (0, ["1 passed, 0 failed, 0 skipped"]))


if __name__ == "__main__":
    unittest.main()
