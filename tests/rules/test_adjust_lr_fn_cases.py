"""The Python client's mapping of torch.optim.Muon's adjust_lr_fn to muond's
(scale_mode, extra_scale_factor) and back (muond.torch) on the shared table
adjust_lr_fn_cases.json, whose mapped modes adjust_lr_fn_cases_test checks
scale as the daemon's own mode of torch's name (core/muon/muon_update.h)."""
import unittest

from muond.torch.groups import scale_from_adjust_lr_fn as _scale_from_adjust_lr_fn
from muond.torch.groups import with_torch_keys as _with_torch_keys
from tests.rules import case_table


class AdjustLrFnCasesTest(unittest.TestCase):
    def setUp(self):
        self.cases = case_table.load("adjust_lr_fn_cases.json")["cases"]
        self.assertTrue(self.cases)

    def test_adjust_lr_fn_to_scale_mode(self):
        for c in self.cases:
            with self.subTest(c["why"]):
                if "error" in c:
                    with self.assertRaises(ValueError) as refused:
                        _scale_from_adjust_lr_fn(c["adjust_lr_fn"], None, None)
                    self.assertIn(c["error"], str(refused.exception))
                else:
                    self.assertEqual(_scale_from_adjust_lr_fn(c["adjust_lr_fn"], None, None),
                                     (c["scale_mode"], c["extra_scale_factor"]))

    def test_scale_mode_back_to_adjust_lr_fn(self):
        """A state dict shows torch's name for the mapped scale: None (torch's
        default) for original, as the group did not name it."""
        for c in self.cases:
            if "error" in c:
                continue
            with self.subTest(c["why"]):
                group = {"algorithm": "muon", "coefficient_type": "simple",
                         "scale_mode": c["scale_mode"],
                         "extra_scale_factor": c["extra_scale_factor"]}
                _with_torch_keys(group)
                expected = None if c["torch_mode"] == "original" else c["adjust_lr_fn"]
                self.assertEqual(group["adjust_lr_fn"], expected)


if __name__ == "__main__":
    unittest.main()
