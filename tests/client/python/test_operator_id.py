"""muond.client.operator_client_id: the operator's client_id derived from the
job token, as the daemon derives it (server/common/operator_id.h). Known
answers from the openssl CLI, the same as
tests/server/common/operator_id_test.cc:
  printf 'muond operator client_id v1' | openssl dgst -sha256 -hmac TOKEN
"""
import unittest

from muond.client import operator_client_id


class OperatorClientIdTest(unittest.TestCase):
    def test_known_answers(self):
        self.assertEqual(
            operator_client_id("job-token"),
            "operator:266ea89347a1bf78b4466711158ca5ac141c014f36d62096a59ee086ceb3ffe2")
        self.assertEqual(
            operator_client_id(None),
            "operator:8e51399fc895d458cdb43e8d95ec80b63c0825f522a12f5ff32f92b7c1e7747f")
        self.assertEqual(operator_client_id(""), operator_client_id(None))

    def test_another_token_is_another_operator(self):
        self.assertNotEqual(operator_client_id("job-token"), operator_client_id("job-token2"))


if __name__ == "__main__":
    unittest.main()
