"""Every constant the Python client still spells out itself equals the one
muond._rules generates from its C++ home (test_rules_py_fresh keeps _rules
itself current): a copy that drifts from the daemon fails here."""
import inspect
import unittest

from muond import _rules, client, torch as muond_torch, wire_enums
from muond._launch_env import MAX_SOCKET_PATH
from muond.v1 import muond_pb2 as pb

# The option names the client takes and puts on the wire (muond.wire_enums,
# from the proto's enums) -> the names the daemon's parsers accept.
_OPTION_NAMES = {
    "coefficient_type": _rules.COEFFICIENT_TYPES,
    "scale_mode": _rules.SCALE_MODES,
    "weight_decay_method": _rules.WEIGHT_DECAY_METHODS,
    "fp32_matmul_prec": _rules.MATMUL_PRECISIONS,
    "ns_algorithm": _rules.NS_ALGORITHMS,
    "gram_dtype": _rules.GRAM_DTYPES,
}


class ClientCopiesTest(unittest.TestCase):
    def test_error_reasons(self):
        self.assertEqual(client.ERROR_DOMAIN, _rules.ERROR_DOMAIN)
        self.assertEqual(client.REASONS, _rules.ERROR_REASONS)

    def test_operator_client_id(self):
        self.assertEqual(client.OPERATOR_CLIENT_ID, _rules.OPERATOR_CLIENT_ID)

    def test_unix_socket_path_bound(self):
        self.assertEqual(MAX_SOCKET_PATH, _rules.MAX_UNIX_SOCKET_PATH_BYTES)

    def test_option_names_on_the_wire(self):
        self.assertEqual(set(wire_enums.MUON_ENUM_FIELDS), set(_OPTION_NAMES))
        for field, enum in wire_enums.MUON_ENUM_FIELDS.items():
            with self.subTest(field):
                self.assertEqual(sorted(wire_enums.names(enum)), sorted(_OPTION_NAMES[field]))

    def test_gram_option_names_checked_at_construction(self):
        self.assertEqual(wire_enums.names(pb.NsAlgorithm), list(_rules.NS_ALGORITHMS))
        self.assertEqual(wire_enums.names(pb.NsIterDType), list(_rules.GRAM_DTYPES))

    def test_live_keys_are_the_step_overrides(self):
        """The group entries sent with every Step (LIVE_KEYS) are the fields of
        the wire's GroupOverride, AdamW's betas as beta1 and beta2."""
        wire = {f.name for f in pb.GroupOverride.DESCRIPTOR.fields} - {"group"}
        live = {key for keys in muond_torch.LIVE_KEYS.values() for key in keys}
        self.assertEqual(live - {"betas"} | {"beta1", "beta2"}, wire)

    def test_simple_coefficients(self):
        """torch.optim.Muon's default ns_coefficients, muond's "simple" set."""
        self.assertEqual(muond_torch._SIMPLE_COEFFICIENTS, _rules.SIMPLE_COEFFICIENTS)

    def test_gram_defaults(self):
        defaults = inspect.signature(muond_torch.Muon.__init__).parameters
        self.assertEqual(defaults["ns_algorithm"].default, _rules.DEFAULT_NS_ALGORITHM)
        self.assertEqual(defaults["gram_dtype"].default, _rules.DEFAULT_GRAM_DTYPE)
        # None and 0 both mean the daemon's measured default.
        self.assertIsNone(defaults["gram_min_aspect_ratio"].default)
        self.assertEqual(_rules.DEFAULT_GRAM_MIN_ASPECT_RATIO, 0.0)

    def test_match_rms_adamw_factor(self):
        self.assertEqual(muond_torch._scale_from_adjust_lr_fn("match_rms_adamw", None, None),
                         ("spectral", _rules.MATCH_RMS_ADAMW_EXTRA_SCALE))


if __name__ == "__main__":
    unittest.main()
