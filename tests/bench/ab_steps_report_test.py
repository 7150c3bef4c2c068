"""bench/ab_steps_report.py on gpu_step_bench.py --out files written here: each run's
milliseconds per set, the means of A and B, B ÷ A, a set one run lacks, a run that wrote
nothing, and the file-name rule."""
import importlib.util
import os
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "ab_steps_report", os.path.join(ROOT, "bench", "ab_steps_report.py"))
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def step_md(llama_ms, moe_ms=None):
    """A gpu_step_bench.py --out file: a header line, per set its round table, then
    other tables whose first column is also a round."""
    text = ("NVIDIA H100 80GB HBM3; median of 10 steps per cell\n\n"
            "### Llama-3-8B, first 4 layers: 28 matrices, 83.24 TFLOP\n\n"
            "| round | muond in-process gram ms |\n|---|---|\n")
    text += "".join(f"| {i + 1} | {ms} |\n" for i, ms in enumerate(llama_ms))
    text += ("\n| round | vs peer (a) |\n|---|---|\n| 1 | n/a |\n\n"
             "| column | ms (rounds) |\n|---|---|\n| muond in-process gram | 1.0 |\n")
    if moe_ms is not None:
        text += ("\n### Qwen3-30B-A3B, first 1 layers: 388 matrices\n\n"
                 "| round | muond in-process gram ms |\n|---|---|\n"
                 f"| 1 | {moe_ms} |\n")
    return text


class AbStepsReportTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, text):
        path = os.path.join(self.dir.name, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def test_reads_each_sets_rounds_and_nothing_else(self):
        path = self.write("A-1.md", step_md([76.92, 77.10], moe_ms=23.80))
        self.assertEqual(report.read_run(path), {
            "Llama-3-8B, first 4 layers": [76.92, 77.10],
            "Qwen3-30B-A3B, first 1 layers": [23.80]})

    def test_means_and_ratio_of_an_abba_run(self):
        paths = [self.write("A-1.md", step_md([78.0], 23.4)),
                 self.write("B-2.md", step_md([79.0], 23.0)),
                 self.write("B-3.md", step_md([81.0], 23.2)),
                 self.write("A-4.md", step_md([80.0], 23.6))]
        lines = report.report(paths).splitlines()
        self.assertEqual(lines[0], "| set | A (1) | B (2) | B (3) | A (4) | mean A | mean B "
                                   "| B ÷ A |")
        self.assertEqual(lines[2], "| Llama-3-8B, first 4 layers | 78.00 | 79.00 | 81.00 | "
                                   "80.00 | 79.00 | 80.00 | 1.013 |")
        self.assertEqual(lines[3], "| Qwen3-30B-A3B, first 1 layers | 23.40 | 23.00 | 23.20 | "
                                   "23.60 | 23.50 | 23.10 | 0.983 |")

    def test_a_set_missing_from_one_build_has_no_ratio(self):
        paths = [self.write("A-1.md", step_md([78.0], 23.4)),
                 self.write("B-2.md", step_md([79.0]))]
        text = report.report(paths)
        self.assertIn("| Llama-3-8B, first 4 layers | 78.00 | 79.00 | 78.00 | 79.00 | 1.013 |",
                      text)
        self.assertNotIn("Qwen3-30B-A3B", text)

    def test_a_run_that_wrote_nothing_shows_as_missing(self):
        paths = [self.write("A-1.md", step_md([78.0])),
                 os.path.join(self.dir.name, "B-2.md"),
                 self.write("B-3.md", step_md([79.0]))]
        self.assertIn("| Llama-3-8B, first 4 layers | 78.00 | - | 79.00 | 78.00 | 79.00 | 1.013 |",
                      report.report(paths))

    def test_names_must_say_which_build(self):
        path = self.write("step_1.md", step_md([78.0]))
        with self.assertRaises(SystemExit) as raised:
            report.report([path])
        self.assertIn("must start with A- or B-", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
