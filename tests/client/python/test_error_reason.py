"""The Python client's error reasons: the same names as the C++ definition
(core/common/error_reason.h, printed by error_reason_names), read from the
gRPC status details a server sends (google.rpc.Status + ErrorInfo bytes built
here by hand, as any googleapis server writes them)."""
import os
import subprocess
import unittest

from muond import client as mc

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_RELPATH = "tests/client/python/error_reason_names"
# bazel test: the runfiles tree; a plain unittest run: $MUOND_BIN_DIR or the
# checkout's bazel-bin after `bazel build //tests/client/python:error_reason_names`.
_CANDIDATES = [os.path.join(d, _RELPATH) for d in
               [os.environ.get("MUOND_BIN_DIR", ""), RUNFILES, os.path.join(RUNFILES, "bazel-bin")]
               if d]
NAMES = next((c for c in _CANDIDATES if os.access(c, os.X_OK)), None)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payloads < 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def google_rpc_status(code: int, message: str, reason: str, domain: str,
                      metadata: dict) -> bytes:
    entries = b"".join(_field(3, _field(1, k.encode()) + _field(2, v.encode()))
                       for k, v in metadata.items())
    info = _field(1, reason.encode()) + _field(2, domain.encode()) + entries
    any_ = _field(1, b"type.googleapis.com/google.rpc.ErrorInfo") + _field(2, info)
    return bytes([1 << 3, code]) + _field(2, message.encode()) + _field(3, any_)


class FakeRpcError:
    def __init__(self, trailing):
        self._trailing = trailing

    def trailing_metadata(self):
        return self._trailing


class ErrorReasonTest(unittest.TestCase):
    @unittest.skipIf(NAMES is None, f"{_RELPATH} is not built (looked at {_CANDIDATES}): "
                     "bazel build //tests/client/python:error_reason_names, or run "
                     "`bazel test //tests/client/python/...`")
    def test_an_invalid_argument_is_also_a_value_error(self):
        import grpc
        refused = mc.MuondError("param 'w': bad", code=grpc.StatusCode.INVALID_ARGUMENT,
                                reason="X", metadata={"param": "w"})
        self.assertIsInstance(refused, mc.InvalidArgumentError)
        self.assertIsInstance(refused, ValueError)
        self.assertIsInstance(refused, mc.MuondError)
        self.assertEqual((str(refused), refused.reason, refused.metadata),
                         ("param 'w': bad", "X", {"param": "w"}))
        for code in (grpc.StatusCode.UNAVAILABLE, None):
            other = mc.MuondError("gone", code=code)
            self.assertNotIsInstance(other, ValueError)
            self.assertIsInstance(other, RuntimeError)

    def test_names_match_the_cpp_definition(self):
        out = subprocess.run([NAMES], capture_output=True, text=True, check=True).stdout
        self.assertEqual(tuple(out.split()), mc.REASONS)

    def test_reads_error_info_from_status_details(self):
        details = google_rpc_status(14, "step 3 failed: a peer daemon is gone", "PEER_GONE",
                                    "muond.dev", {"step_id": "3"})
        error = FakeRpcError((("other", "x"), ("grpc-status-details-bin", details)))
        self.assertEqual(mc.error_reason(error), mc.PEER_GONE)
        self.assertEqual(dict(mc.error_info(error).metadata), {"step_id": "3"})

    def test_no_or_foreign_or_broken_details_give_no_reason(self):
        foreign = google_rpc_status(14, "x", "PEER_GONE", "example.com", {})
        for trailing in [None, (), (("grpc-status-details-bin", foreign),),
                         (("grpc-status-details-bin", b"\xff\xff not a proto"),)]:
            self.assertEqual(mc.error_reason(FakeRpcError(trailing)), "")
        self.assertEqual(mc.error_reason(ValueError("not an RPC error")), "")


if __name__ == "__main__":
    unittest.main()
