"""What the Python client still spells out itself, against the daemon's
rules: the client reads most shared constants from muond._rules (generated
from their C++ homes; test_rules_py_fresh keeps it current), so what is left
here are the names the client puts on the wire (from the proto) and the
copies with no generated source."""
import unittest

from muond import _rules, wire_enums
from muond.torch import groups
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
    "variant": _rules.MUON_VARIANTS,
}


class ClientCopiesTest(unittest.TestCase):
    def test_option_names_on_the_wire(self):
        self.assertEqual(set(wire_enums.MUON_ENUM_FIELDS), set(_OPTION_NAMES))
        for field, enum in wire_enums.MUON_ENUM_FIELDS.items():
            with self.subTest(field):
                self.assertEqual(sorted(wire_enums.names(enum)), sorted(_OPTION_NAMES[field]))

    def test_live_keys_are_the_step_overrides(self):
        """The group entries sent with every Step (LIVE_KEYS) are the fields of
        the wire's GroupOverride, AdamW's betas as beta1 and beta2."""
        wire = {f.name for f in pb.GroupOverride.DESCRIPTOR.fields} - {"group"}
        live = {key for keys in groups.LIVE_KEYS.values() for key in keys}
        self.assertEqual(live - {"betas"} | {"beta1", "beta2"}, wire)

    def test_gram_min_aspect_ratio_default(self):
        """The client's None and the daemon's 0 both mean the measured default."""
        from muond.torch.options import NewtonSchulzOptions
        self.assertIsNone(NewtonSchulzOptions().gram_min_aspect_ratio)
        self.assertEqual(_rules.DEFAULT_GRAM_MIN_ASPECT_RATIO, 0.0)


if __name__ == "__main__":
    unittest.main()
