"""The Python client's copy of the daemon's default socket
(muond.placement.default_socket) on the shared table socket_dir_cases.json,
which socket_dir_cases_test runs the daemon's PrivateSocketDir on
(server/common/unix_socket.h)."""
import os
import tempfile
import unittest

from muond.placement import default_socket
from tests.rules import case_table


class SocketDirCasesTest(unittest.TestCase):
    def test_default_socket_matches_the_table(self):
        cases = case_table.load("socket_dir_cases.json")["cases"]
        self.assertTrue(cases)
        with tempfile.TemporaryDirectory() as tmp:
            def expand(text):
                return text.replace("<tmp>", tmp).replace("<uid>", str(os.geteuid()))

            for c in cases:
                with self.subTest(c["why"]):
                    env = ({} if c["xdg_runtime_dir"] is None
                           else {"XDG_RUNTIME_DIR": expand(c["xdg_runtime_dir"])})
                    self.assertEqual(default_socket("job", 3, env=env),
                                     f"unix://{expand(c['dir'])}/muond-job-3.sock")


if __name__ == "__main__":
    unittest.main()
