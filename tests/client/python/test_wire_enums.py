"""muond.wire_enums: the option names the Python client puts on the wire are
exactly the core's (lowercase, as the daemons' parsers took them when the
wire carried strings); anything else is refused naming the field, never
silently sent as UNSPECIFIED (the daemon's default) or matched in another
case."""
import unittest

from muond import wire_enums
from muond.v1 import muond_pb2 as pb


class WireEnumsTest(unittest.TestCase):
    def test_names_round_trip(self):
        for field, enum in wire_enums.MUON_ENUM_FIELDS.items():
            names = wire_enums.names(enum)
            self.assertTrue(names, field)
            for name in names:
                value = wire_enums.to_wire(enum, field, name)
                self.assertNotEqual(value, 0, (field, name))
                self.assertEqual(wire_enums.from_wire(enum, value, "default"), name)

    def test_state_options_are_the_wire_names_and_auto(self):
        self.assertEqual(wire_enums.state_options("state_dtype"),
                         ["auto", "fp32", "bf16", "fp8_e4m3"])
        self.assertEqual(wire_enums.state_options("state_location"), ["device", "host"])
        self.assertEqual(wire_enums.state_to_wire("state_dtype", "auto"),
                         pb.STATE_DTYPE_UNSPECIFIED)
        self.assertEqual(wire_enums.state_to_wire("state_dtype", "fp8_e4m3"),
                         pb.STATE_DTYPE_FP8_E4M3)
        self.assertEqual(wire_enums.state_to_wire("state_location", "host"),
                         pb.STATE_LOCATION_HOST)
        with self.assertRaisesRegex(ValueError, "state_location .*not in"):
            wire_enums.state_to_wire("state_location", "auto")

    def test_unset_is_the_default(self):
        self.assertEqual(wire_enums.to_wire(pb.ScaleMode, "scale_mode", None), 0)
        self.assertEqual(wire_enums.to_wire(pb.ScaleMode, "scale_mode", ""), 0)
        self.assertEqual(wire_enums.from_wire(pb.ScaleMode, 0, "spectral"), "spectral")

    def test_other_spellings_refused(self):
        self.assertEqual(wire_enums.to_wire(pb.ScaleMode, "scale_mode", "shape_scaling"),
                         pb.SCALE_MODE_SHAPE_SCALING)
        for bad in ("unspecified", "UNSPECIFIED", "SHAPE_SCALING", "Shape_Scaling",
                    "shape-scaling", "nope"):
            with self.assertRaisesRegex(ValueError, "scale_mode .*not in"):
                wire_enums.to_wire(pb.ScaleMode, "scale_mode", bad)


if __name__ == "__main__":
    unittest.main()
