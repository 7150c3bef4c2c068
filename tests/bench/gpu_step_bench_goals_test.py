"""bench/gpu_step_bench.py's ratio table marks each ratio against the targets of
its set: met or missed, per peer, torch and the daemon's overhead, and no mark
where a set has no target."""
import importlib.util
import os
import types
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location(
    "gpu_step_bench", os.path.join(ROOT, "bench", "gpu_step_bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

COLS = ["torch", "peer_a", "inproc_gram", "daemon_gram"]
ARGS = types.SimpleNamespace(syrk=False, gpu_clocks=False)
OPTS = types.SimpleNamespace(gram_restarts=[3], muond_default_restarts=[3],
                             gram_min_aspect=None)


def ratio_row(name, row):
    table = bench.set_table(name, 1, 0, [(768, 2048)], COLS, [row], {}, ARGS, OPTS)
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if "vs peer (a)" in line)
    return [c.strip() for c in lines[head + 2].strip("|").split("|")]


class GoalMarksTest(unittest.TestCase):
    def test_moe_set_peer_target_and_no_torch_target(self):
        # 40 / 25 = 1.6 >= 1.5; torch has no target on the MoE set.
        cells = ratio_row("qwen3_30b_a3b", {"torch": 150.0, "peer_a": 40.0,
                                            "inproc_gram": 24.5, "daemon_gram": 25.0})
        self.assertEqual(cells[1], "1.600x (met: goal 1.5x)")
        self.assertEqual(cells[3], "6.000x")
        self.assertEqual(cells[5], "1.020 (missed: goal <= 1.01)")

    def test_dense_set_marks_misses_and_the_daemon_goal_met(self):
        # 88 / 80 = 1.1 < 1.3; 150 / 80 = 1.875 < 2.3; 80 / 79.5 <= 1.01.
        cells = ratio_row("llama3_8b", {"torch": 150.0, "peer_a": 88.0,
                                        "inproc_gram": 79.5, "daemon_gram": 80.0})
        self.assertEqual(cells[1], "1.100x (missed: goal 1.3x)")
        self.assertEqual(cells[3], "1.875x (missed: goal 2.3x)")
        self.assertEqual(cells[5], "1.006 (met: goal <= 1.01)")

    def test_no_mark_without_a_value(self):
        cells = ratio_row("llama3_8b", {"torch": 150.0, "daemon_gram": 80.0})
        self.assertEqual(cells[1], "n/a")
        self.assertEqual(cells[5], "n/a")


if __name__ == "__main__":
    unittest.main()
