"""The Python client's copy of the token file rule
(muond.client.read_token_file) on the shared table token_file_cases.json,
which token_file_cases_test runs the servers' ReadTokenFile on
(server/common/auth.h)."""
import os
import tempfile
import unittest

from muond.client import read_token_file
from tests.rules import case_table


def _content(case: dict) -> bytes:
    once = (bytes.fromhex(case["content_hex"]) if "content_hex" in case
            else case["content"].encode("ascii"))
    return once * case.get("repeat", 1)


def _make_case(case: dict, path: str) -> str:
    """The case's file (or directory, or nothing) at `path`."""
    kind = case.get("kind", "file")
    if kind == "missing":
        return path
    if kind == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.write(_content(case))
    os.chmod(path, int(case["mode"], 8))
    return path


class TokenFileCasesTest(unittest.TestCase):
    def test_read_token_file_matches_the_table(self):
        cases = case_table.load("token_file_cases.json")["cases"]
        self.assertTrue(cases)
        with tempfile.TemporaryDirectory() as tmp:
            for i, c in enumerate(cases):
                path = _make_case(c, os.path.join(tmp, f"token_case_{i}"))
                with self.subTest(c["why"]):
                    self.assertNotIn("python_token", c,
                                     "the table states one rule for both languages")
                    if "error" in c:
                        with self.assertRaises((ValueError, FileNotFoundError)) as refused:
                            read_token_file(path)
                        self.assertIn(c["error"], str(refused.exception))
                    elif "token_bytes" in c:
                        self.assertEqual(len(read_token_file(path)), c["token_bytes"])
                    else:
                        self.assertEqual(read_token_file(path), c["token"])


if __name__ == "__main__":
    unittest.main()
