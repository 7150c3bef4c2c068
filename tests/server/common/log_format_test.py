"""--log_format on muond and muond-coordinator.

* json: every line a real coordinator and two host daemons write while a
  trainer registers, steps and closes and while they shut down is one JSON
  object with time (RFC 3339, UTC, microseconds), severity, file, line,
  thread, message and server; the daemons' lines also carry job and rank.
* A bad --log_format exits non-zero naming the flag and the allowed values.
* Every log path of a process (glog severities, gRPC core, protobuf, a
  failed CHECK) reaches stderr as JSON only (json_log_probe); in text mode
  the same run writes glog's usual lines.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import unittest

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(_REPO, "tests", "client", "python", "contract"))
from cluster import Cluster, find_binaries  # noqa: E402
from muond.torch import Muon  # noqa: E402

KEYS = ["time", "severity", "file", "line", "thread", "message", "server"]
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
SEVERITIES = {"INFO", "WARNING", "ERROR", "FATAL", "DEBUG"}
PROBE = os.path.join(_HERE, "json_log_probe")


def parse_lines(test: unittest.TestCase, text: str, where: str) -> list[dict]:
    """Every line of `text` as a JSON object with the documented keys."""
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            test.fail(f"{where} line {n} is not JSON ({e}): {line!r}")
        test.assertIsInstance(record, dict, f"{where} line {n}")
        test.assertEqual(list(record)[:len(KEYS)], KEYS, f"{where} line {n}: {line}")
        test.assertRegex(record["time"], TIME, f"{where} line {n}")
        when = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
        test.assertEqual(when.utcoffset(), datetime.timedelta(0))
        test.assertIn(record["severity"], SEVERITIES, f"{where} line {n}")
        test.assertIsInstance(record["file"], str)
        test.assertNotIn("/", record["file"])
        test.assertIsInstance(record["line"], int)
        test.assertIsInstance(record["thread"], int)
        test.assertIsInstance(record["message"], str)
        records.append(record)
    return records


class LogFormatTest(unittest.TestCase):
    def setUp(self):
        self.coordinator_bin, self.daemon_bin = find_binaries(self)

    def test_json_lines_from_a_real_run(self):
        json_flag = ["--log_format=json"]
        cluster = Cluster(2, extra_daemon_args=json_flag, coordinator_args=json_flag).start()
        try:
            w = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
            opt = Muon([{"params": [w], "name": "dense", "param_names": ["w"]}], lr=0.02,
                       daemons=cluster.daemons, job_id=cluster.job_id, gtp_size=1, tp_size=2,
                       rpc_timeout=30, wait_healthy_timeout=30)
            try:
                for s in range(3):
                    w.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(s))
                    opt.step()
            finally:
                opt.close()
            names = ["muond-rank0", "muond-rank1", "coordinator"]
            for name in names:  # their shutdown lines belong to the run
                cluster.process(name).send_signal(signal.SIGTERM)
            for name in names:
                self.assertEqual(cluster.process(name).wait(60), 0, name)
            logs = {}
            for name in names:
                with open(os.path.join(cluster.tmp, f"{name}.log")) as f:
                    logs[name] = f.read()  # stdout and stderr together
        finally:
            cluster.stop()
        for rank in (0, 1):
            name = f"muond-rank{rank}"
            records = parse_lines(self, logs[name], name)
            messages = "\n".join(r["message"] for r in records)
            for r in records:
                self.assertEqual((r["server"], r["job"], r["rank"]),
                                 ("muond-daemon", cluster.job_id, rank), r)
            self.assertRegex(messages, r"serving on \S+ \(cpu\)")  # its device named
            self.assertIn("registered 1 params", messages)
            self.assertIn("step engine ready", messages)
            self.assertIn("shutting down", messages)
        records = parse_lines(self, logs["coordinator"], "coordinator")
        for r in records:
            self.assertEqual(r["server"], "muond-coordinator", r)
            self.assertNotIn("job", r)
        messages = "\n".join(r["message"] for r in records)
        self.assertIn("serving on port", messages)
        self.assertIn("shutting down", messages)

    def test_a_bad_log_format_is_refused_naming_the_flag(self):
        for binary in (self.coordinator_bin, self.daemon_bin):
            run = subprocess.run([binary, "--log_format=xml"], capture_output=True, text=True,
                                 timeout=60)
            self.assertNotEqual(run.returncode, 0, binary)
            self.assertIn("log_format", run.stderr)
            self.assertIn("xml", run.stderr)
            self.assertIn("text, json", run.stderr)

    def test_every_log_path_of_a_process_is_json(self):
        run = subprocess.run([PROBE, "--log_format=json", "--v=1"], capture_output=True,
                             text=True, timeout=60)
        self.assertEqual(run.returncode, -signal.SIGABRT, run.stderr)  # the failed CHECK
        self.assertEqual(run.stdout, "")
        records = parse_lines(self, run.stderr, "probe")
        got = [(r["severity"], r["message"]) for r in records]
        self.assertEqual(got[:7], [
            ("INFO", 'info "quoted"\nsecond line\tand a tab'),
            ("WARNING", "warning"),
            ("ERROR", "error"),
            ("INFO", "verbose"),
            ("ERROR", "gpr error 7"),
            ("ERROR", "protobuf error"),
            ("INFO", "invalid utf-8: \ufffd\ufffd"),
        ])
        self.assertEqual(len(records), 8)
        fatal = records[7]
        self.assertEqual(fatal["severity"], "FATAL")
        self.assertIn("Check failed: 1 + 1 == 3", fatal["message"])
        self.assertIn("fatal on purpose", fatal["message"])
        self.assertIsInstance(fatal["stack"], list)
        self.assertTrue(fatal["stack"])
        for r in records:
            self.assertEqual((r["server"], r["job"], r["rank"]), ("json-log-probe", "probe-job", 3))
        self.assertEqual({r["file"] for r in records}, {"json_log_probe.cc"})

    def test_text_is_glog_as_before(self):
        run = subprocess.run([PROBE, "--v=1"], capture_output=True, text=True, timeout=60,
                             errors="replace")
        self.assertEqual(run.returncode, -signal.SIGABRT, run.stderr)
        lines = run.stderr.splitlines()
        glog = re.compile(r"^[IWEF]\d{4,8} \d\d:\d\d:\d\d\.\d{6} +\d+ json_log_probe\.cc:\d+\] ")
        self.assertRegex(lines[0], glog)
        self.assertTrue(lines[0].endswith('info "quoted"'), lines[0])
        self.assertIn("second line\tand a tab", lines)
        self.assertTrue(any(glog.match(x) and x.endswith("] warning") for x in lines))
        self.assertIn("*** Check failure stack trace: ***", lines)
        self.assertFalse(any(x.startswith("{") for x in lines))


if __name__ == "__main__":
    unittest.main()
