"""Slurm's compressed node lists (muond/launch/slurm.py): expanded in order
with zero padding kept and bracket groups multiplied; malformed lists refused
naming the variable; the first host built without expanding, and a list of
more than 100000 hosts refused before it is built. Expected values are
written out by hand.
"""
import re
import unittest

from muond.launch.errors import LaunchError
from muond.launch.slurm import expand_nodelist, first_host
from tests.client.python.launch.options import layout


class NodelistTest(unittest.TestCase):
    def test_expansion(self):
        cases = [
            ("node1", ["node1"]),
            ("a,b", ["a", "b"]),
            ("gpu[001-004,010],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010",
                                         "login1"]),
            ("a[01-03,7],b1", ["a01", "a02", "a03", "a7", "b1"]),
            ("n[8-11]", ["n8", "n9", "n10", "n11"]),
            ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
            ("x[3]-ib", ["x3-ib"]),
            ("h[1,3],g[2-3]", ["h1", "h3", "g2", "g3"]),
        ]
        for text, hosts in cases:
            self.assertEqual(expand_nodelist(text), hosts, text)

    def test_malformed(self):
        for text, phrase in [("gpu[1-2", "'[' without ']'"), ("gpu1-2]", "']' without '['"),
                             ("a[[1]]", "nested"), ("a,,b", "empty host"),
                             ("n[3-1]", "runs backwards"), ("n[a-b]", "is not N or N-M"),
                             ("n[]", "is not N or N-M")]:
            with self.assertRaisesRegex(LaunchError, re.escape(phrase), msg=text) as cm:
                expand_nodelist(text)
            self.assertIn("$SLURM_JOB_NODELIST", str(cm.exception))

    def test_first_host_without_expanding(self):
        """Only the first host is built; the total is counted, and over
        100000 hosts refused (r[0-99999]n[0-99999] is 10^10 names)."""
        self.assertEqual(first_host("r[5-999]n[07-99],x"), "r5n07")
        self.assertEqual(first_host("gpu[001-004],b"), "gpu001")
        for text in ("r[0-99999]n[0-99999]", "n[0-99999999]", "a[1-60000],b[1-60000]"):
            with self.assertRaisesRegex(LaunchError, r"\$SLURM_JOB_NODELIST=.*more than "
                                        r"100000 hosts") as cm:
                layout(["--device", "cpu"], {"SLURM_JOB_NODELIST": text, "SLURM_NNODES": "2",
                                           "SLURM_NODEID": "1", "MUOND_JOB_ID": "j",
                                           "MUOND_TOKEN_FILE": "/t"})
            self.assertLess(len(str(cm.exception)), 300, text)
        self.assertEqual(len(expand_nodelist("n[1-100000]")), 100000)


if __name__ == "__main__":
    unittest.main()
