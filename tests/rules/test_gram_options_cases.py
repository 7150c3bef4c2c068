"""The Python client's copy of the Gram Newton-Schulz option rules
(muond.torch.groups.check_gram_options) on the shared table gram_options_cases.json,
which gram_options_cases_test runs the daemon's rules on
(core/muon/newton_schulz.h ValidateGramOptions)."""
import unittest

from muond.torch.groups import check_gram_options
from tests.rules import case_table

_OPTIONS = ("ns_steps", "ns_algorithm", "gram_restarts", "gram_dtype", "gram_min_aspect_ratio")


def _group(case: dict) -> dict:
    group = {key: case[key] for key in _OPTIONS}
    if group["gram_min_aspect_ratio"] is not None:
        group["gram_min_aspect_ratio"] = case_table.number(group["gram_min_aspect_ratio"])
    group["fp32_matmul_prec"] = case.get("fp32_matmul_prec", "highest")
    if case.get("custom_coefficients"):
        # A group's custom coefficients are one flat list (the wire's).
        group["coefficient_type"] = "custom"
        group["custom_coefficients"] = [x for t in case["custom_coefficients"] for x in t]
    return group


class GramOptionsCasesTest(unittest.TestCase):
    def test_check_gram_options_matches_the_table(self):
        cases = case_table.load("gram_options_cases.json")["cases"]
        self.assertTrue(cases)
        for c in cases:
            self.assertNotIn("python_error", c, "the table states one rule for both languages")
            error = c["error"]
            with self.subTest(c["why"]):
                if error is None:
                    check_gram_options(0, _group(c))
                else:
                    with self.assertRaises(ValueError) as refused:
                        check_gram_options(0, _group(c))
                    self.assertIn(error, str(refused.exception))


if __name__ == "__main__":
    unittest.main()
