"""The Python client's copy of the Gram Newton-Schulz option rules
(muond.torch.check_gram_options) on the shared table gram_options_cases.json,
which gram_options_cases_test runs the daemon's rules on
(core/muon/newton_schulz.h ValidateGramOptions)."""
import unittest

from muond.torch import check_gram_options
from tests.rules import case_table

_OPTIONS = ("ns_steps", "ns_algorithm", "gram_restarts", "gram_dtype", "gram_min_aspect_ratio")


def _group(case: dict) -> dict:
    group = {key: case[key] for key in _OPTIONS}
    if group["gram_min_aspect_ratio"] is not None:
        group["gram_min_aspect_ratio"] = case_table.number(group["gram_min_aspect_ratio"])
    return group


class GramOptionsCasesTest(unittest.TestCase):
    def test_check_gram_options_matches_the_table(self):
        cases = case_table.load("gram_options_cases.json")["cases"]
        self.assertTrue(cases)
        for c in cases:
            # python_error: where the Python copy is known to answer otherwise
            # (python_differs says why).
            error = c["python_error"] if "python_error" in c else c["error"]
            with self.subTest(c["why"]):
                if error is None:
                    check_gram_options(0, _group(c))
                else:
                    with self.assertRaises(ValueError) as refused:
                        check_gram_options(0, _group(c))
                    self.assertIn(error, str(refused.exception))


if __name__ == "__main__":
    unittest.main()
