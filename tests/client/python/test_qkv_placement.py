"""muond.torch.qkv_placement: where Q, K and V (or each head) of a split
fused QKV weight live, from the weight's own place. Checked against the
seed's rule applied to row numbers: each rank's staging rows (perm) must be
the rows of its shard that the rule's Q, K, V hold, in that order, and each
matrix's row count per GTP chunk must match."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))

import torch  # noqa: E402

from muond.qkv_split import RowSplit  # noqa: E402
from muond.torch import placement as P  # noqa: E402
from muond.torch.qkv_placement import split_places  # noqa: E402

SHAPES = (6, 3, 3)
GROUPS, COLS = 6, 8
ROWS = GROUPS * sum(SHAPES)


def seed_parts(rows: torch.Tensor) -> list:
    """The seed's split of a column of row numbers: (groups, q+k+v) split on dim 1."""
    return [x.reshape(-1) for x in torch.split(rows.view(GROUPS, sum(SHAPES)),
                                               list(SHAPES), dim=1)]


def fsdp_place(g: int, world: int, tp_dim=None, T=1, t=0) -> P.ParamPlace:
    tp_rows = ROWS // T if tp_dim == 0 else ROWS
    chunks = P.chunk_rows(tp_rows, world)
    return P.ParamPlace("d", 1, 0, world, g, T, t, (ROWS, COLS), (chunks[g], COLS),
                        tp_dim=tp_dim, gtp_sharded=True,
                        gtp_rows=chunks if len(set(chunks)) > 1 else (), kind="dtensor")


class SplitPlacesTest(unittest.TestCase):
    def test_fsdp_chunks_cutting_the_groups(self):
        world = 4
        rows = torch.arange(ROWS)
        owned = torch.chunk(rows, world)
        for g in range(world):
            places, perm = split_places("w", fsdp_place(g, world), RowSplit(SHAPES))
            mine = owned[g]
            want = torch.cat([part[torch.isin(part, mine)] for part in seed_parts(rows)])
            self.assertEqual((mine[0] + torch.tensor(perm)).tolist(), want.tolist())
            for name, part in zip(("w[q]", "w[k]", "w[v]"), seed_parts(rows)):
                counts = tuple(int(torch.isin(part, c).sum()) for c in owned)
                self.assertEqual(places[name].full_shape, (len(part), COLS))
                self.assertEqual(places[name].local_shape, (counts[g], COLS))
                self.assertEqual(places[name].gtp_rows or (counts[0],) * world, counts)

    def test_tp_blocks_of_whole_groups_and_uneven_ones_refused(self):
        rows = torch.arange(ROWS)
        for t in range(2):
            place = P.ParamPlace("d", 1, 0, 1, 0, 2, t, (ROWS, COLS), (ROWS // 2, COLS),
                                 tp_dim=0, kind="dtensor")
            places, perm = split_places("w", place, RowSplit(SHAPES))
            block = rows[t * ROWS // 2:(t + 1) * ROWS // 2]
            want = torch.cat([part[torch.isin(part, block)] for part in seed_parts(rows)])
            self.assertEqual((block[0] + torch.tensor(perm)).tolist(), want.tolist())
            self.assertEqual(places["w[q]"].local_shape, (GROUPS // 2 * SHAPES[0], COLS))
        uneven = P.ParamPlace("d", 1, 0, 1, 0, 4, 0, (ROWS, COLS), (ROWS // 4, COLS),
                              tp_dim=0, kind="dtensor")
        with self.assertRaisesRegex(ValueError, r"param w\[q\]: column-parallel TP blocks "
                                                r"hold its rows unevenly"):
            split_places("w", uneven, RowSplit(SHAPES))

    def test_per_head_blocks(self):
        places, perm = split_places("w", fsdp_place(0, 1), RowSplit(SHAPES, head_dim=3))
        self.assertEqual(len(places), GROUPS * sum(SHAPES) // 3)
        self.assertEqual(perm, list(range(ROWS)))  # heads are contiguous, in order
        self.assertEqual(places["w[k.1.0]"].offset, (12 + 6) * COLS)


if __name__ == "__main__":
    unittest.main()
