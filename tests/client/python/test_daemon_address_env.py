"""A malformed $MUOND_DAEMON is refused at once, naming the variable, its
value and the accepted forms (muond.torch.discovery.check_daemon_address),
by discover() and by muond.torch.Muon, instead of being retried until the
health timeout; well-formed addresses pass unchanged."""
import os
import unittest
from unittest import mock

import torch

from muond.torch import Muon
from muond.torch import discovery as D


class DaemonAddressEnvTest(unittest.TestCase):
    def test_well_formed_addresses_pass(self):
        for address in ("unix:///run/muond/d.sock", "unix:/tmp/d.sock", "localhost:7071",
                        "node-1.cluster:7071", "10.0.0.2:1", "[::1]:65535"):
            with self.subTest(address=address):
                self.assertEqual(D.discover(None, {"MUOND_DAEMON": address}).address, address)

    def test_malformed_addresses_are_refused_naming_the_variable(self):
        for address, why in [("localhost", "no HOST:PORT"),
                             ("localhost:", "port '' is not in 1-65535"),
                             ("localhost:0", "port '0' is not in 1-65535"),
                             ("localhost:70000", "port '70000'"),
                             ("host:7x", "port '7x'"),
                             (":7071", "no HOST:PORT"),
                             ("::1:7071", "needs brackets"),
                             ("bad host:7071", "host 'bad host'"),
                             ("unix:relative.sock", "must be absolute"),
                             ("unix://relative.sock", "must be absolute")]:
            with self.subTest(address=address):
                with self.assertRaises(ValueError) as caught:
                    D.discover(None, {"MUOND_DAEMON": address, "RANK": "0"})
                message = str(caught.exception)
                self.assertIn(f"$MUOND_DAEMON={address!r} is malformed", message)
                self.assertIn(why, message)
                self.assertIn("unix:///ABS/PATH", message)
                self.assertIn("HOST:PORT", message)

    def test_muon_refuses_it_before_waiting_for_a_daemon(self):
        w = torch.nn.Parameter(torch.zeros(4, 4))
        env = {"MUOND_DAEMON": "localhost", "RANK": "0", "WORLD_SIZE": "1"}
        with mock.patch.dict(os.environ, env):
            # The wait a well-formed but absent daemon would get: the refusal
            # must come first, from the address itself.
            with self.assertRaisesRegex(ValueError, r"\$MUOND_DAEMON='localhost' is malformed"):
                Muon([{"params": [w], "param_names": ["w"]}], wait_healthy_timeout=60)


if __name__ == "__main__":
    unittest.main()
