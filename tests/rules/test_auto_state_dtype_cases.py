"""The Python client's copy of the auto state dtype rule
(muond.torch.state_storage.wire_dtype) on the shared table
auto_state_dtype_cases.json, which auto_state_dtype_cases_test runs the
daemon's rule (core/common/state_options.h AutoStateDType) on."""
import unittest

import torch

from muond.torch.state_storage import wire_dtype
from tests.rules import case_table

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class AutoStateDTypeCasesTest(unittest.TestCase):
    def test_wire_dtype_matches_the_table(self):
        cases = case_table.load("auto_state_dtype_cases.json")["cases"]
        self.assertTrue(cases)
        for c in cases:
            with self.subTest(c["why"]):
                params = [torch.zeros(2, dtype=_TORCH[d]) for d in c["param_dtypes"]]
                group = {"params": params, "state_dtype": "auto"}
                self.assertEqual(wire_dtype(group), c["state_dtype"])


if __name__ == "__main__":
    unittest.main()
