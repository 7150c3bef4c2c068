"""The launcher's copy of the job id rule (muond.launch.config.check_job_id) on
the shared table job_id_cases.json, which job_id_cases_test runs the daemon's
rule (server/common/job_id.h CheckJobId) on."""
import unittest

from muond.launch.config import check_job_id
from tests.rules import case_table


class JobIdCasesTest(unittest.TestCase):
    def test_check_job_id_matches_the_table(self):
        cases = case_table.load("job_id_cases.json")["cases"]
        self.assertTrue(cases)
        for c in cases:
            with self.subTest(c["why"]):
                if c["error"] is None:
                    self.assertEqual(check_job_id(c["job_id"], "--job-id"), c["job_id"])
                else:
                    with self.assertRaises(ValueError) as refused:
                        check_job_id(c["job_id"], "--job-id")
                    self.assertIn(c["error"], str(refused.exception))


if __name__ == "__main__":
    unittest.main()
