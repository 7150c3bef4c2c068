"""muond.torch.batched_placement: where each matrix of a batched Muon param
([..., m, n]) lives, from DTensor placements (no process group: a mesh is its
rank layout) and for plain params. Every place is checked against torch's
own slicing: the element run a place names in the rank's local tensor (cut
by torch.chunk as DTensor cuts it) must be that matrix's local block."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))

import torch  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from muond.torch import placement as P  # noqa: E402
from muond.torch.batched_placement import (matrix_placements, place_dtensor_batch,  # noqa: E402
                                           place_plain_batch)


class Mesh:
    """What placement reads of a DeviceMesh: its rank layout and dim names."""

    def __init__(self, shape, names):
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.mesh_dim_names = names
        self.ndim = len(shape)


def local_of(full, mesh, placements, rank):
    """The rank's local tensor as DTensor cuts it (torch.chunk per mesh dim)."""
    coord = P.mesh_coordinate(mesh, rank)
    block = full
    for i, pl in enumerate(placements):
        if pl.is_shard():
            # torch.chunk may make fewer chunks than ranks: the rest are empty.
            chunks = torch.chunk(block, int(mesh.mesh.shape[i]), dim=pl.dim)
            block = (chunks[coord[i]] if coord[i] < len(chunks)
                     else block.narrow(pl.dim, 0, 0))
    return block.contiguous()


def places(full_shape, mesh, placements, rank):
    roles = P.mesh_roles(mesh, [matrix_placements(placements, len(full_shape))])
    full = torch.arange(float(torch.tensor(full_shape).prod())).reshape(full_shape)
    local = local_of(full, mesh, placements, rank)
    return full, local, place_dtensor_batch("w", full_shape, tuple(local.shape), mesh,
                                            placements, roles, rank)


class DTensorBatchTest(unittest.TestCase):
    def check_blocks(self, full_shape, mesh, placements):
        """Every rank's places name its local blocks; each matrix is held
        (rows > 0) where torch puts it and the row counts add up."""
        held = {}
        for rank in range(mesh.mesh.numel()):
            full, local, got = places(full_shape, mesh, placements, rank)
            flat = local.reshape(-1)
            for name, pl in got.items():
                rows, cols = pl.local_shape
                if rows == 0:
                    continue
                block = flat[pl.offset:pl.offset + rows * cols].reshape(rows, cols)
                index = tuple(int(i) for i in name[2:-1].split(","))
                matrix = full[index]
                # The block's first element locates it in the full matrix.
                where = (matrix == block[0, 0]).nonzero()[0].tolist()
                self.assertTrue(torch.equal(
                    matrix[where[0]:where[0] + rows, where[1]:where[1] + cols], block), name)
                held[name] = held.get(name, 0) + rows * cols
        matrix_numel = full_shape[-1] * full_shape[-2]
        return held, matrix_numel

    def test_experts_whole_per_rank_uneven_with_an_empty_rank(self):
        mesh = Mesh((4,), ("fsdp",))
        held, numel = self.check_blocks((6, 40, 16), mesh, (Shard(0),))
        self.assertEqual(held, {f"w[{e}]": numel for e in range(6)})
        _, _, got = places((6, 40, 16), mesh, (Shard(0),), 1)
        self.assertEqual(got["w[2]"].gtp_rows, (0, 40, 0, 0))
        self.assertEqual((got["w[2]"].offset, got["w[3]"].offset), (0, 640))
        self.assertEqual(got["w[0]"].local_shape, (0, 16))
        _, local, got = places((6, 40, 16), mesh, (Shard(0),), 3)  # torch.chunk: none here
        self.assertEqual(local.shape[0], 0)
        self.assertTrue(all(pl.local_shape == (0, 16) for pl in got.values()))

    def test_rows_of_every_expert(self):
        mesh = Mesh((4,), ("fsdp",))
        held, numel = self.check_blocks((3, 40, 16), mesh, (Shard(1),))
        self.assertEqual(held, {f"w[{e}]": numel for e in range(3)})
        _, _, got = places((3, 40, 16), mesh, (Shard(1),), 2)
        self.assertEqual((got["w[1]"].G, got["w[1]"].g, got["w[1]"].gtp_sharded), (4, 2, True))

    def test_experts_over_ep_rows_column_parallel_over_tp(self):
        mesh = Mesh((2, 2), ("ep", "tp"))
        placements = (Shard(0), Shard(1))
        held, numel = self.check_blocks((6, 40, 16), mesh, placements)
        self.assertEqual(held, {f"w[{e}]": numel for e in range(6)})
        _, _, got = places((6, 40, 16), mesh, placements, 3)  # ep 1, tp 1
        self.assertEqual((got["w[4]"].tp_dim, got["w[4]"].t, got["w[4]"].gtp_rows),
                         (0, 1, (0, 20)))

    def test_columns_row_parallel_and_a_deeper_batch(self):
        mesh = Mesh((2,), ("tp",))
        held, numel = self.check_blocks((2, 3, 8, 6), mesh, (Shard(3),))
        self.assertEqual(sorted(held), [f"w[{i},{j}]" for i in range(2) for j in range(3)])
        self.assertTrue(all(v == numel for v in held.values()))

    def test_refusals_name_the_param_and_the_rule(self):
        cases = [
            ((6, 8, 4), Mesh((2,), ("tp",)), (Shard(0),), "is the domain's TP axis"),
            ((2, 2, 8, 4), Mesh((2, 2), ("a", "b")), (Shard(0), Shard(1)),
             "are all GTP axes"),
            ((6, 8, 4), Mesh((2, 2), ("dp", "tp")), (_StridedShard(0, split_factor=2), Shard(1)),
             "_StridedShard(0) on mesh dim 0 over its batch"),
        ]
        for shape, mesh, placements, rule in cases:
            with self.assertRaises(ValueError, msg=rule) as caught:
                roles = P.mesh_roles(mesh, [matrix_placements(placements, len(shape))])
                place_dtensor_batch("w", shape, shape, mesh, placements, roles, 0)
            self.assertIn(rule, str(caught.exception))


class PlainBatchTest(unittest.TestCase):
    def test_each_matrix_has_the_params_place_and_its_offset(self):
        got = place_plain_batch("moe", (3, 4, 5), P.place_ddp((3, 4, 5), 2, 1))
        self.assertEqual(list(got), ["moe[0]", "moe[1]", "moe[2]"])
        self.assertEqual([pl.offset for pl in got.values()], [0, 20, 40])
        self.assertTrue(all(pl.full_shape == (4, 5) and pl.D == 2 and pl.d == 1
                            for pl in got.values()))

    def test_megatron_tags_on_a_batched_param_are_refused(self):
        p = torch.nn.Parameter(torch.zeros(3, 4, 5))
        p.tensor_model_parallel, p.partition_dim = True, 0
        with self.assertRaisesRegex(ValueError, r"param moe: Megatron tags .* 2-D weight"):
            P.place_params([P.Request("moe", p, "muon")], P.Options(world=2, rank=0))


if __name__ == "__main__":
    unittest.main()
