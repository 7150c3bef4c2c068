"""Shared-memory rebinding: the model's param and grad view the shm objects,
packed into one object per dtype (params and grads apart)."""
import mmap
import os
import sys
import shutil
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import start_cluster  # noqa: E402
from muond.shm import ShmBuffer  # noqa: E402
from muond.torch import Muon  # noqa: E402
from muond.torch import wire as _wire  # noqa: E402
from muond.torch.memory import ALIGN_BYTES, Regions, SharedParams, release  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402


def open_second_mapping(name: str) -> np.ndarray:
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return np.frombuffer(mm, np.float32)


class ShmBufferTest(unittest.TestCase):
    def test_two_mappings_share_memory(self):
        b = ShmBuffer("test", 10)
        try:
            self.assertTrue(b.name.startswith(f"/muond-test-{os.getpid()}-"))
            self.assertEqual(os.stat(b.path).st_mode & 0o777, 0o600)
            other = open_second_mapping(b.name)
            other[3] = 42.0
            self.assertEqual(b.flat[3].item(), 42.0)
            b.flat[5] = -1.5
            self.assertEqual(other[5], -1.5)
        finally:
            b.unlink()
        self.assertFalse(os.path.exists(b.path))


class RegionsTest(unittest.TestCase):
    def test_one_region_per_shm_object(self):
        regions = Regions()
        a, b = ShmBuffer("test", 10), ShmBuffer("test", 3)
        try:
            self.assertEqual(regions.shm(a), a.name)
            self.assertEqual(regions.shm(b), b.name)
            group = pb.ParamGroup(params=[pb.Param(param=pb.TensorRef(region=b.name),
                                                   grad=pb.TensorRef(region=a.name))])
            self.assertEqual(regions.used_by([group]), [
                pb.MemoryRegion(name=b.name, kind=pb.MEMORY_KIND_HOST_SHM, shm_name=b.name, byte_size=12),
                pb.MemoryRegion(name=a.name, kind=pb.MEMORY_KIND_HOST_SHM, shm_name=a.name, byte_size=40)])
        finally:
            a.unlink()
            b.unlink()

    def test_cuda_buffers_of_one_allocation_share_its_widest_region(self):
        # Buffers in one caching-allocator block share its IPC handle: one
        # region, as large as the farthest storage end any of them reaches.
        regions = Regions()
        h1, h2 = bytes(64), bytes(range(64))
        first = regions.cuda(0, h1, 512)
        self.assertEqual(regions.cuda(0, h1, 2048), first)
        self.assertEqual(regions.cuda(0, h1, 1024), first)
        other = regions.cuda(0, h2, 256)
        self.assertNotEqual(other, first)
        group = pb.ParamGroup(params=[pb.Param(param=pb.TensorRef(region=first),
                                               grad=pb.TensorRef(region=first))])
        self.assertEqual(regions.used_by([group]), [
            pb.MemoryRegion(name=first, kind=pb.MEMORY_KIND_CUDA_IPC, cuda_ipc_handle=h1, device=0,
                            byte_size=2048)])


class PackingTest(unittest.TestCase):
    """SharedParams packs every param, and apart every grad, of one dtype
    into one shm object, each at an ALIGN_BYTES boundary."""

    def test_params_of_two_dtypes_make_four_regions_of_aligned_disjoint_views(self):
        torch.manual_seed(0)
        shapes = [(3, 5), (0, 4), (7,), (2, 2), (1, 9)] * 20
        params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes
                  for dtype in (torch.float32, torch.bfloat16)]
        values = [p.detach().clone() for p in params]
        memory = SharedParams("packing")
        group = pb.ParamGroup()
        for i, p in enumerate(params):
            pslot, gslot = memory.rebind(p, p.numel())
            shape, strides = _wire.whole(p)
            group.params.append(pb.Param(name=f"p{i}", param=pslot.ref(0, shape, strides),
                                         grad=gslot.ref(0, shape, strides)))
        self.assertEqual(memory.buffers, [])  # nothing allocated while placing
        memory.allocate([[group]])
        try:
            regions = memory.regions.used_by([group])
            self.assertEqual(len(regions), 4)  # (param, grad) x (fp32, bf16)
            self.assertEqual(len({r.shm_name for r in regions}), 4)
            spans = {r.name: [] for r in regions}
            for p, value, prm in zip(params, values, group.params):
                torch.testing.assert_close(p.detach(), value, rtol=0, atol=0)
                for ref in (prm.param, prm.grad):
                    self.assertEqual(ref.byte_offset % ALIGN_BYTES, 0)
                    spans[ref.region].append((ref.byte_offset,
                                              ref.byte_offset + p.numel() * p.element_size()))
                # The model's tensor is the shm bytes the ref names.
                region = next(r for r in regions if r.name == prm.param.region)
                with open("/dev/shm" + region.shm_name, "rb") as f:
                    f.seek(prm.param.byte_offset)
                    raw = f.read(p.numel() * p.element_size())
                self.assertEqual(raw, p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
            for region in regions:
                ends = sorted(spans[region.name])
                self.assertTrue(all(a[1] <= b[0] for a, b in zip(ends, ends[1:])))
                self.assertLessEqual(ends[-1][1], region.byte_size)
        finally:
            release(memory.buffers)


class RebindTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.cluster, self.addresses = start_cluster(self.dir, 4)

    def tearDown(self):
        for d in self.cluster.daemons:
            d.stop()

    def test_model_param_views_shm(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 9, bias=True),
                                    torch.nn.Linear(9, 6, bias=False))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        weights = [p for p in model.parameters() if p.ndim == 2]
        biases = [p for p in model.parameters() if p.ndim == 1]
        opt = Muon([{"params": weights}, {"params": biases, "algorithm": "adamw"}],
                   daemons=self.addresses, job_id="rebind", gtp_size=2, tp_size=2)
        try:
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
                self.assertIsNone(p.grad)  # as torch.optim: construction leaves .grad
            w = model[0].weight  # (9, 8): split, padded span of 10 rows
            req = self.cluster.daemons[0].requests[0]
            ref = next(pp for g in req.groups for pp in g.params if pp.name == "group0.param0")
            regions = {r.name: r for r in req.regions}
            # Shard (g=0, t=0) starts where the param's span does.
            at = ref.param.byte_offset // 4
            other = open_second_mapping(regions[ref.param.region].shm_name)
            other[at + 1 * 8 + 2] = 123.0
            self.assertEqual(w[1, 2].item(), 123.0)
            w.data[4, 5] = -7.0
            self.assertEqual(other[at + 4 * 8 + 5], -7.0)
            # backward accumulates into the shm grad in place
            opt.zero_grad(set_to_none=False)  # binds .grad to the zeroed shm grad
            gptr = w.grad.data_ptr()
            self.assertIs(w.grad, {id(p): g for p, g in opt._grads}[id(w)])
            model(torch.randn(3, 8)).sum().backward()
            self.assertEqual(w.grad.data_ptr(), gptr)
            at = ref.grad.byte_offset // 4
            g_other = open_second_mapping(regions[ref.grad.region].shm_name)
            np.testing.assert_array_equal(g_other[at:at + 72].reshape(9, 8), w.grad.numpy())
            self.assertTrue((g_other[at + 72:at + 80] == 0).all())  # the pad row
        finally:
            names = [b.shm.path for b in opt._buffers]
            opt.close()
        self.assertFalse(any(os.path.exists(p) for p in names))
        model(torch.randn(2, 8))  # the model still works after close


if __name__ == "__main__":
    unittest.main()
