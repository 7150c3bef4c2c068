"""The Python client's copies of constants the generator cannot print
(muond.client, muond.torch, muond.state) against the shared table
server_limits.json, which server_limits_test and state_entry_suffixes_test
check the C++ homes against (server/common/auth.h,
core/step/engine_state.cc, the CUDA runtime)."""
import unittest

from muond import client, state
from muond.torch.memory import CUDA_IPC_HANDLE_SIZE
from tests.rules import case_table


class ServerLimitsTest(unittest.TestCase):
    def setUp(self):
        self.table = case_table.load("server_limits.json")

    def test_token_rules(self):
        self.assertEqual(client.TOKEN_METADATA_KEY, self.table["token_metadata_key"])
        self.assertEqual(client.MAX_TOKEN_BYTES, self.table["max_token_bytes"])

    def test_state_chunk_bounds(self):
        self.assertEqual(client.DEFAULT_STATE_CHUNK_BYTES,
                         self.table["default_state_chunk_bytes"])
        self.assertEqual(client.MAX_STATE_CHUNK_BYTES, self.table["max_state_chunk_bytes"])
        # The client's receive bound is the daemon's: the largest chunk plus
        # the overhead of its message.
        self.assertEqual(client._MAX_MESSAGE_BYTES, self.table["max_state_chunk_bytes"]
                         + self.table["state_chunk_overhead_bytes"])

    def test_state_entry_suffixes(self):
        suffixes = {algorithm: sorted(keys.values())
                    for algorithm, keys in state.TORCH_KEYS.items()}
        self.assertEqual(suffixes, {algorithm: sorted(names) for algorithm, names
                                    in self.table["state_entry_suffixes"].items()})

    def test_cuda_ipc_handle_bytes(self):
        self.assertEqual(CUDA_IPC_HANDLE_SIZE, self.table["cuda_ipc_handle_bytes"])


if __name__ == "__main__":
    unittest.main()
