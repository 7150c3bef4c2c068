"""QK-clip in muond.torch.Muon on fake daemons (in-process): the clip rule
against the per-head float64 reference written from the paper
(qk_clip_reference.py) for MHA, GQA, Megatron's fused QKV and MLA, maxima
above, at and below the threshold, zero and negative (no NaN); the global
rows each local shard holds (every placement kind) against slicing the full
row numbers as the layouts do; split mode over 2 daemons bitwise equal to
one; a refused or skipped step and a refused input leave the weights as they
were and send nothing; every input error names its layer or param and rule.

The steps run with lr = 0 and weight_decay = 0, so the daemons' update
leaves the weights as they were and the change is the clip alone."""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import unittest
from types import SimpleNamespace

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qk_clip_reference as ref  # noqa: E402
from fake_daemon import start_cluster  # noqa: E402

from muond import split  # noqa: E402
from muond.torch import (Muon, QKClip, QKClipAttention, QKClipMLA,  # noqa: E402
                         reduce_max_logits)
from muond.torch import placement as P  # noqa: E402
from muond.torch import qk_clip as Q  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402

TAU = 10.0
# Heads above, at and below tau, zero and negative.
MAXIMA8 = torch.tensor([25.0, 10.0, 3.0, 0.0, -4.0, 12.5, 40.0, 9.99])


def weights(seed: int, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


class FakeDaemons(unittest.TestCase):
    def daemons(self, world: int = 1):
        directory = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        cluster, addresses = start_cluster(directory, world)
        for d in cluster.daemons:
            self.addCleanup(d.stop)
        return cluster, addresses

    def muon(self, named, layers, world: int = 1, tau=TAU, alpha=0.5, **kw):
        cluster, addresses = self.daemons(world)
        opt = Muon([{"params": [p for _, p in named], "param_names": [n for n, _ in named]}],
                   daemons=addresses, job_id="fake", lr=0.0, weight_decay=0.0,
                   gtp_size=world, qk_clip=QKClip(layers, threshold=tau, alpha=alpha), **kw)
        self.addCleanup(opt.close)
        return cluster, opt

    @staticmethod
    def grads(params):
        for p in params:
            p.grad = torch.ones_like(p)


class ClipRuleTest(FakeDaemons):
    def assert_close(self, got, want):
        self.assertTrue(torch.allclose(got, want, rtol=1e-6, atol=0), (got - want).abs().max())

    def test_mha_and_gqa_against_the_paper(self):
        for kv, alpha in ((8, 0.5), (2, 0.5), (2, 0.3)):
            wq, wk = weights(1, (8 * 4, 16), (kv * 4, 16))
            want = ref.clip_separate(wq.detach(), wk.detach(), MAXIMA8, TAU, alpha, 8, kv, 4)
            layer = QKClipAttention("attn", num_heads=8, num_kv_heads=kv, head_dim=4, q=wq, k=wk)
            _, opt = self.muon([("wq", wq), ("wk", wk)], [layer], alpha=alpha)
            self.grads([wq, wk])
            opt.step(qk_max_logits={"attn": MAXIMA8})
            self.assertFalse(torch.isnan(wq).any() or torch.isnan(wk).any())
            self.assert_close(wq.detach(), want[0])
            self.assert_close(wk.detach(), want[1])
            # Heads at or below tau (also 0 and negative) are bitwise untouched.
            before = wq.detach().clone()
            opt.step(qk_max_logits={"attn": torch.full((8,), TAU)})
            self.assertTrue(torch.equal(wq.detach(), before))

    def test_fused_qkv_against_the_paper(self):
        (w,) = weights(2, (2 * (4 + 2) * 3, 16))  # 8 heads, 2 groups, head_dim 3
        want = ref.clip_fused(w.detach(), MAXIMA8, TAU, 0.5, 8, 2, 3)
        layer = QKClipAttention("attn", num_heads=8, num_kv_heads=2, head_dim=3, qkv=w)
        _, opt = self.muon([("qkv", w)], [layer])
        self.grads([w])
        opt.step(qk_max_logits={"attn": MAXIMA8})
        self.assert_close(w.detach(), want)

    def test_mla_against_the_paper(self):
        wq, wkv = weights(3, (4 * (3 + 2), 16), (4 * (3 + 5), 8))
        maxima = MAXIMA8[:4]
        want = ref.clip_mla(wq.detach(), wkv.detach(), maxima, TAU, 0.5, 4, 3, 2, 5)
        layer = QKClipMLA("mla", num_heads=4, qk_nope_head_dim=3, qk_rope_head_dim=2,
                          v_head_dim=5, q=wq, kv=wkv)
        _, opt = self.muon([("wq", wq), ("wkv", wkv)], [layer])
        self.grads([wq, wkv])
        opt.step(qk_max_logits={"mla": maxima})
        self.assert_close(wq.detach(), want[0])
        self.assert_close(wkv.detach(), want[1])

    def test_split_mode_over_two_daemons_is_bitwise_one_daemon(self):
        out = []
        for world in (1, 2):
            (w,) = weights(4, (2 * (4 + 2) * 3, 16))
            layer = QKClipAttention("attn", num_heads=8, num_kv_heads=2, head_dim=3, qkv=w)
            _, opt = self.muon([("qkv", w)], [layer], world=world)
            for step in range(3):
                self.grads([w])
                opt.step(qk_max_logits={"attn": MAXIMA8 * (step + 1)})
            out.append(w.detach().clone())
        self.assertTrue(torch.equal(out[0], out[1]))


class LocalRowsTest(unittest.TestCase):
    """Each placement's local rows named by their global row number, against
    the full row numbers cut as the layouts cut the weight."""

    def rows_of(self, place, local_rows: int):
        opt = SimpleNamespace(places={"w": place}, layouts={"w": "local"})
        rows, real = Q.local_rows(opt, "w", torch.zeros(local_rows, 4))
        return rows[real].tolist()

    def test_megatron_shards_match_muond_split(self):
        for (Pr, Qc), tp_dim in (((32, 8), 0), ((15, 8), 1), ((30, 8), 0)):
            layout = split.plan_split((Pr, Qc), 2, 2, tp_dim)
            full = torch.arange(Pr, dtype=torch.float64)[:, None].expand(Pr, Qc)
            buffer = torch.full((layout.buffer_numel,), -1.0, dtype=torch.float64)
            buffer[:Pr * Qc] = full.reshape(-1)
            for s in layout.shards:
                shard = buffer.as_strided(s.shape, s.strides, s.offset)
                want = [int(r) for r in shard[:, 0].tolist() if r >= 0]
                place = P.ParamPlace("dense", 1, 0, 2, s.g, 2, s.t, (Pr, Qc), s.shape,
                                     tp_dim=layout.tp_dim, gtp_sharded=True,
                                     pad_length=layout.pad_length, kind="megatron")
                self.assertEqual(self.rows_of(place, s.shape[0]), want, (Pr, tp_dim, s))

    def test_fsdp_chunks_and_tp_blocks(self):
        # FSDP2's torch.chunk rows (uneven, an empty one) on 3 rows over 4.
        for rows in (38, 3):
            blocks = P.chunk_rows(rows, 4)
            parts = torch.arange(rows).chunk(4)
            for g in range(4):
                place = P.ParamPlace("m", 1, 0, 4, g, 1, 0, (rows, 4), (blocks[g], 4),
                                     gtp_sharded=True,
                                     gtp_rows=blocks if len(set(blocks)) > 1 else ())
                want = parts[g].tolist() if g < len(parts) else []
                self.assertEqual(self.rows_of(place, blocks[g]), want)
        # FSDP2 x TP: the GTP block cuts the TP-local rows (_StridedShard).
        for t in range(2):
            for g in range(2):
                place = P.ParamPlace("m", 1, 0, 2, g, 2, t, (32, 4), (8, 4), tp_dim=0,
                                     gtp_sharded=True)
                want = list(range(t * 16 + g * 8, t * 16 + g * 8 + 8))
                self.assertEqual(self.rows_of(place, 8), want)
        # Row-parallel TP and DDP hold every row.
        for place in (P.ParamPlace("m", 1, 0, 1, 0, 2, 1, (6, 8), (6, 4), tp_dim=1),
                      P.place_ddp((6, 4), 2, 1)):
            self.assertEqual(self.rows_of(place, 6), list(range(6)))


class RefusalTest(FakeDaemons):
    def setUp(self):
        self.wq, self.wk = weights(5, (8 * 4, 16), (2 * 4, 16))
        self.layer = QKClipAttention("layers.0.attn", num_heads=8, num_kv_heads=2, head_dim=4,
                                     q=self.wq, k=self.wk)

    def opt(self):
        self.cluster, opt = self.muon([("wq", self.wq), ("wk", self.wk)], [self.layer])
        self.grads([self.wq, self.wk])
        return opt

    def assert_unchanged_after(self, opt, error, pattern, maxima, refused_here=True):
        """step() raises `error`; nothing moved. `refused_here`: the trainer's
        own check refused, so its daemon heard only that refusal (the job's
        other ranks fail the step with it); else the daemon refused a Step."""
        before = [self.wq.detach().clone(), self.wk.detach().clone()]
        requests = len(self.cluster.daemons[0].step_requests)
        with self.assertRaisesRegex(error, pattern):
            opt.step(qk_max_logits=maxima)
        self.assertTrue(torch.equal(self.wq, before[0]) and torch.equal(self.wk, before[1]))
        sent = self.cluster.daemons[0].step_requests[requests:]
        self.assertEqual(len(sent), 1)
        self.assertEqual(bool(sent[0].trainer_refusal), refused_here)
        if refused_here:
            self.assertRegex(sent[0].trainer_refusal, pattern)
        self.assertEqual(opt.step_id, 0)

    def test_input_errors_name_the_layer_and_the_rule(self):
        opt = self.opt()
        name = r"qk_max_logits\['layers\.0\.attn'\]"
        for maxima, error, pattern in (
                ({"layers.0.attn": torch.ones(7)}, ValueError,
                 name + r" has shape \(7,\), expected \(8,\) \(num_heads\)"),
                ({"layers.0.attn": torch.tensor([1.0] * 7 + [math.nan])}, ValueError,
                 name + r" is not finite at heads \[7\] \(\[nan\]\); nothing was applied"),
                ({"layers.0.attn": torch.tensor([math.inf] + [1.0] * 7)}, ValueError,
                 name + r" is not finite at heads \[0\]"),
                ({}, ValueError, r"missing \['layers\.0\.attn'\]"),
                ({"layers.0.attn": MAXIMA8, "other": MAXIMA8}, ValueError,
                 r"unknown \['other'\]"),
                ([MAXIMA8], TypeError, r"must be a dict")):
            self.assert_unchanged_after(opt, error, pattern, maxima)
        opt.step(qk_max_logits={"layers.0.attn": MAXIMA8})  # and the next step works
        self.assertEqual(opt.step_id, 1)

    def test_a_refused_step_is_not_clipped(self):
        opt = self.opt()

        def refuse(request, context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "non-finite gradients: wq")

        self.cluster.daemons[0].on_step = refuse
        self.assert_unchanged_after(opt, Exception, "non-finite gradients",
                                    {"layers.0.attn": MAXIMA8}, refused_here=False)

    def test_a_skipped_step_is_not_clipped(self):
        opt = self.opt()
        self.cluster.daemons[0].on_step = lambda request, context: pb.StepResponse(
            step_id=request.step_id, skipped_nonfinite=["wq"])
        before = self.wq.detach().clone()
        opt.step(qk_max_logits={"layers.0.attn": MAXIMA8})
        self.assertTrue(torch.equal(self.wq, before))

    def test_option_errors_name_the_layer_and_the_shape(self):
        wq, wk, b = self.wq, self.wk, torch.nn.Parameter(torch.zeros(4, 16))
        for layers, tau, alpha, pattern in (
                ([self.layer], 0.0, 0.5, r"threshold must be a finite number > 0, got 0\.0"),
                ([self.layer], math.inf, 0.5, r"threshold must be a finite number > 0"),
                ([self.layer], TAU, 1.5, r"alpha must be a finite number in \[0, 1\], got 1\.5"),
                ([QKClipAttention("a", num_heads=8, num_kv_heads=2, head_dim=5, q=wq, k=wk)],
                 TAU, 0.5, r"qk_clip layer 'a': q param wq has full shape \(32, 16\), expected "
                 r"\(40, hidden\) \(num_heads x head_dim = 8 x 5\)"),
                ([QKClipAttention("a", num_heads=8, num_kv_heads=3, head_dim=4, q=wq, k=wk)],
                 TAU, 0.5, r"num_heads 8 is not a multiple of num_kv_heads 3"),
                ([QKClipAttention("a", num_heads=8, head_dim=4, q=wq, k=b)], TAU, 0.5,
                 r"qk_clip layer 'a': k is not a param of this optimizer"),
                ([QKClipAttention("a", num_heads=8, head_dim=4, q=wq)], TAU, 0.5,
                 r"give q= and k= .* or qkv="),
                ([self.layer, self.layer], TAU, 0.5, r"listed twice")):
            cluster, addresses = self.daemons()
            with self.assertRaisesRegex(ValueError, pattern):
                Muon([{"params": [wq, wk], "param_names": ["wq", "wk"]}], daemons=addresses,
                     job_id="fake", qk_clip=QKClip(layers, threshold=tau, alpha=alpha))
            # Refused at construction: nothing stays registered.
            self.assertEqual(cluster.daemons[0].groups, [])

    def test_max_logits_without_a_qk_clip_option(self):
        cluster, addresses = self.daemons()
        opt = Muon([self.wq], daemons=addresses, job_id="fake", lr=0.0)
        self.addCleanup(opt.close)
        with self.assertRaisesRegex(ValueError, r"needs an optimizer built with qk_clip="):
            opt.step(qk_max_logits={"layers.0.attn": MAXIMA8})


class ReduceTest(unittest.TestCase):
    def test_without_a_process_group_the_maxima_as_float32(self):
        out = reduce_max_logits({"b": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
                                 "a": torch.tensor([3.0])})
        self.assertEqual(sorted(out), ["a", "b"])
        self.assertEqual(out["b"].dtype, torch.float32)
        self.assertEqual(out["b"].tolist(), [1.0, 2.0])


if __name__ == "__main__":
    unittest.main()
