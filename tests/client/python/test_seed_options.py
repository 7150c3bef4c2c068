"""The seed API's options (Megatron-Core's LayerShardedMuon) in
muond.torch.Muon, against docs/seed-options.md and the seed's own signature:

* the doc's table lists exactly the seed constructor's arguments, as the seed
  document gives them (SEED_SIGNATURE below, copied from it);
* an option the table calls "same name" is a muond.torch.Muon keyword, and
  every other is one seed_options rules on;
* a seed option at muond's behaviour registers the same groups, on the wire
  too, as leaving it out (fake daemons);
* every refused value raises ValueError naming the option, the value and the
  reason before any RPC."""
import os
import re
import sys
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import FakeClusterTestCase  # noqa: E402 (puts client/python on sys.path)
from test_muon_options import comparable_groups, make_groups, wire_groups  # noqa: E402

from muond.torch import Muon  # noqa: E402
from muond.torch import options as muond_options  # noqa: E402
from muond.torch.seed_options import SEED_ONLY  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "..", "..", "..", "docs", "seed-options.md")

# LayerShardedMuon's constructor, as the seed document gives it.
SEED_SIGNATURE = (
    "params", "lr", "momentum", "weight_decay", "nesterov", "fp32_matmul_prec",
    "coefficient_type", "num_ns_steps", "scale_mode", "extra_scale_factor",
    "gtp_remat_group", "tp_group", "ns_batch_size", "use_syrk", "concurrent_groups",
    "use_decoupled_weight_decay", "split_qkv", "is_qkv_fn", "qkv_split_shapes",
    "pg_collection", "tp_mode")
# torch.optim.Muon's own arguments, which muond.torch.Muon takes positionally.
TORCH_ARGUMENTS = ("params", "lr", "weight_decay", "momentum", "nesterov")

ACCEPTED = [dict(tp_mode="duplicated"), dict(tp_mode="distributed"), dict(tp_mode="auto"),
            dict(concurrent_groups=True), dict(use_decoupled_weight_decay=True),
            dict(gtp_remat_group=None), dict(tp_group=None), dict(pg_collection=None)]
REFUSED = [
    (dict(tp_mode="blockwise"), "tp_mode='blockwise'", "each TP shard on its own"),
    (dict(tp_mode="column"), "tp_mode='column'", "'blockwise', 'duplicated', 'distributed'"),
    (dict(tp_group=object()), "tp_group=", "DTensor placements, its Megatron tags"),
    (dict(gtp_remat_group=object()), "gtp_remat_group=", "gtp_size=/tp_size=/g=/t="),
    (dict(pg_collection=object()), "pg_collection=", "daemons own the communicators"),
    (dict(concurrent_groups=False), "concurrent_groups=False", "no serial mode"),
    (dict(use_decoupled_weight_decay=False), "use_decoupled_weight_decay=False",
     "L2 weight decay"),
    (dict(use_decoupled_weight_decay=True, weight_decay_method="none"),
     "use_decoupled_weight_decay=True", "contradicts weight_decay_method='none'"),
    (dict(num_ns_steps=5), "num_ns_steps=5", "ns_steps="),
]


def table_rows() -> dict:
    """seed option -> what the doc's table says muond does with it."""
    rows = {}
    with open(TABLE) as f:
        for line in f:
            m = re.match(r"\| `(\w+)`[^|]*\| (.*) \|$", line.strip())
            if m:
                rows[m.group(1)] = m.group(2)
    return rows


class SeedOptionsTableTest(unittest.TestCase):
    def test_the_table_lists_exactly_the_seed_signature(self):
        self.assertEqual(sorted(table_rows()), sorted(SEED_SIGNATURE))

    def test_same_name_options_are_keywords_and_the_rest_are_ruled_on(self):
        keywords = set(muond_options.FLAT_KEYWORDS) | set(TORCH_ARGUMENTS)
        for option, says in table_rows().items():
            with self.subTest(option=option):
                if says.startswith("same"):
                    self.assertIn(option, keywords)
                    self.assertNotIn(option, SEED_ONLY)
                else:
                    self.assertIn(option, SEED_ONLY)
                    self.assertNotIn(option, keywords)
        self.assertEqual(set(SEED_ONLY) - set(SEED_SIGNATURE), set())


class SeedOptionsTest(FakeClusterTestCase):

    def build(self, **kwargs):
        opt = Muon(make_groups(), lr=0.02, daemons=self.addresses, job_id="fake",
                   client_id="seed", **kwargs)
        self.addCleanup(opt.close)
        return opt

    def test_accepted_values_register_what_leaving_them_out_does(self):
        plain = self.build()
        want_groups, want_wire = comparable_groups(plain), wire_groups(self.cluster.daemons)
        plain.close()
        for kwargs in ACCEPTED:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                opt = self.build(**kwargs)
                self.assertEqual(comparable_groups(opt), want_groups)
                self.assertEqual(wire_groups(self.cluster.daemons), want_wire)
                opt.close()

    def test_refused_values_name_option_value_and_reason_before_any_rpc(self):
        before = len(self.cluster.daemons[0].requests)
        for kwargs, named, reason in REFUSED:
            with self.subTest(named=named):
                with self.assertRaises(ValueError) as raised:
                    self.build(**kwargs)
                message = str(raised.exception)
                self.assertIn(named, message)
                self.assertIn(reason, message)
                self.assertIn("docs/seed-options.md", message)
        self.assertEqual(len(self.cluster.daemons[0].requests), before)

    def test_a_process_group_is_named_by_its_type(self):
        with self.assertRaises(ValueError) as raised:
            self.build(tp_group=torch.nn.Linear(2, 2))
        self.assertIn("tp_group=<Linear>", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
