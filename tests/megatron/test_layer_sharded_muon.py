"""muond.megatron.LayerShardedMuon in one process (one host daemon): the
seed's constructor against Megatron-Core's own TensorParallelMuon (the
parent of Megatron's LayerShardedMuon: the same update in duplicated mode),
main_grad, registration at first use (Megatron's mixed-precision wrapper
swaps its fp32 main params in after construction), the setters' checks, and
the factory's refusals."""
from __future__ import annotations

import itertools
import os
import sys
import unittest

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "client", "python", "contract"))
from cluster import Cluster, find_binaries  # noqa: E402

try:
    import megatron_cpu  # noqa: E402,F401  (typing.override)
    import megatron_trainer  # noqa: E402
    from megatron.core.optimizer import OptimizerConfig  # noqa: E402
    from megatron.core.optimizer.emerging_optimizers import (  # noqa: E402
        _EMERGING_OPTIMIZERS, TensorParallelMuon)
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

from muond.megatron import LayerShardedMuon, get_megatron_optimizer, tp_partition_dim  # noqa: E402

SHAPES = [(48, 32), (32, 96), (64, 64)]
STEPS = 3
TOL = 2e-5  # fp32 Newton-Schulz in two implementations, compounded over STEPS
_names = (f"lsm{i}" for i in itertools.count())


def make_params(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype) * 0.1) for s in SHAPES]


def grads(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


class LayerShardedMuonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.cluster = Cluster(1).start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def muond(self, params, **kw):
        c = self.cluster
        opt = LayerShardedMuon(params, daemons=c.daemons, job_id=c.job_id, token=c.token,
                               shard_mode="local", name=next(_names), **kw)
        self.addCleanup(opt.close)
        return opt

    @unittest.skipUnless(HAVE_MEGATRON, "megatron-core is not installed")
    def test_matches_megatrons_tensor_parallel_muon(self):
        kw = megatron_trainer.SEED_MUON_OPTIONS
        ref_params, got_params = make_params(), make_params()
        ref = TensorParallelMuon(ref_params, **kw)
        got = self.muond(got_params, gtp_remat_group=None, tp_group=None, **kw)
        for step in range(STEPS):
            for pr, pg, g in zip(ref_params, got_params, grads(step)):
                pr.grad, pg.grad = g.clone(), g.clone()
            ref.step()
            got.step()
        for pr, pg, p0 in zip(ref_params, got_params, make_params()):
            self.assertLessEqual(megatron_trainer.rel_diff(pg.detach(), pr.detach()), TOL)
            self.assertGreater(float((pr - p0).abs().max()), 1e-3)  # the steps moved it

    def test_main_grad_is_the_grad(self):
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=dtype):
                by_grad, by_main = make_params(dtype), make_params(dtype)
                a, b = self.muond(by_grad), self.muond(by_main)
                for step in range(STEPS):
                    for pa, pb, g in zip(by_grad, by_main, grads(step)):
                        pa.grad = g.to(dtype)
                        pb.grad, pb.main_grad = None, g  # Megatron DDP: fp32 main_grad
                    a.step()
                    b.step()
                    self.assertTrue(all(p.grad is None for p in by_main))
                for pa, pb in zip(by_grad, by_main):
                    self.assertTrue(torch.equal(pa, pb))

    def test_registers_the_params_in_the_groups_at_first_step(self):
        """As Megatron's Float16OptimizerWithFloat16Params: fp32 copies of the
        model's bf16 params replace them in the groups after construction."""
        model = make_params(torch.bfloat16)
        opt = self.muond(model)
        main = [p.detach().float() for p in model]
        opt.param_groups[0]["params"] = main
        before = [p.clone() for p in model]
        for p, g in zip(main, grads(0)):
            p.grad = g
        opt.step()
        for p, p0 in zip(main, make_params(torch.bfloat16)):
            self.assertGreater(float((p - p0.float()).abs().max()), 1e-3)
        for p, b in zip(model, before):
            self.assertTrue(torch.equal(p, b))  # the wrapper copies back, not muond
        self.assertEqual(len(opt.state_dict()["state"]), len(SHAPES))

    def test_set_param_ns_homes_checks_and_keeps(self):
        params = make_params()
        opt = self.muond(params)
        opt.set_param_ns_homes({id(params[0]): (0, 0)})
        self.assertEqual(opt.param_ns_homes, {id(params[0]): (0, 0)})
        with self.assertRaisesRegex(ValueError, "not id\\(\\) of a param"):
            opt.set_param_ns_homes({12345: (0, 0)})
        with self.assertRaisesRegex(ValueError, "outside its .* domain of size \\(1, 1\\)"):
            opt.set_param_ns_homes({id(params[1]): (1, 0)})

    def stepped(self, **kw):
        params = make_params()
        opt = self.muond(params, **kw)
        for p, g in zip(params, grads(0)):
            p.grad = g
        opt.step()
        return params, opt

    def test_bad_main_grads_named_before_any_is_used(self):
        params = make_params()
        opt = self.muond(params)
        before = [p.clone() for p in params]
        for bad, rule in ((torch.zeros(3, 3), "has shape \\(3, 3\\)"),
                          (torch.zeros(SHAPES[1], dtype=torch.int64), "has dtype torch.int64"),
                          ("junk", "is a str, not a tensor")):
            with self.subTest(rule=rule):
                params[0].main_grad = grads(0)[0]
                params[1].main_grad = bad
                with self.assertRaisesRegex(ValueError, "param .*: its main_grad " + rule):
                    opt.step()
                self.assertIsNone(params[0].grad)  # nothing fed before the check
        for p, b in zip(params, before):
            self.assertTrue(torch.equal(p, b))

    def test_a_param_replaced_after_registration_is_refused(self):
        params, opt = self.stepped()
        opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.zeros(9, 9))
        with self.assertRaisesRegex(ValueError, "not the tensor registered in its place"):
            opt.step()

    def test_failed_first_use_registration_says_so(self):
        opt = self.muond(make_params())
        opt.param_groups[0]["params"][0] = torch.nn.Parameter(torch.zeros(5))  # 1-D: not Muon's
        with self.assertRaises(ValueError):
            opt.step()
        with self.assertRaisesRegex(RuntimeError, "registration at first use failed"):
            opt.step()
        with self.assertRaisesRegex(RuntimeError, "add_param_group after close"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))]})

    def test_set_param_ns_homes_refuses_junk(self):
        params = make_params()
        opt = self.muond(params)
        for home in ((0, -7), (0, 10**30), (0.9, 0), ("0", "0"), (True, 0), 0, None,
                     (0, 0, 0)):
            with self.subTest(home=home), self.assertRaisesRegex(
                    ValueError, "param 0 of param group 0"):
                opt.set_param_ns_homes({id(params[0]): home})
        self.assertEqual(opt.param_ns_homes, {})

    def test_process_groups_of_the_wrong_kind(self):
        with self.assertRaisesRegex(TypeError, "tp_group must be a torch.distributed"):
            self.muond(make_params(), tp_group=5)
        opt = self.muond(make_params())
        with self.assertRaisesRegex(TypeError, "group 0: gtp_remat_group must be"):
            opt.set_group_process_groups({0: (5, None)})

    def test_set_group_process_groups_refuses_junk_and_changes_nothing(self):
        opt = self.muond([{"params": make_params()[:2]}, {"params": make_params()[2:]}])
        for mapping in ({0.7: (None, None)}, {"0": (None, None)}, {None: (None, None)},
                        {True: (None, None)}, {0: None}, {0: (None,)},
                        {0: (None, None), 1: (None, 42)}, [(0, (None, None))]):
            with self.subTest(mapping=mapping), self.assertRaises((TypeError, ValueError)):
                opt.set_group_process_groups(mapping)
            self.assertEqual(opt._layout.group_options, {})

    def test_set_group_process_groups_after_a_step_keeps_assigned_state(self):
        params, opt = self.stepped()
        opt.state[params[0]]["momentum_buffer"] = torch.full_like(params[0], 7.0)
        opt.set_group_process_groups({0: (None, None)})
        self.assertTrue(torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                                    torch.full_like(params[0], 7.0)))

    def test_blockwise_warns_only_with_tp(self):
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.muond(make_params(), tp_mode="blockwise")
        self.assertFalse([w for w in caught if "blockwise" in str(w.message)])  # T == 1

    def test_seed_option_refusals(self):
        with self.assertRaisesRegex(ValueError, "tp_mode='rowwise'"):
            self.muond(make_params(), tp_mode="rowwise")
        with self.assertRaisesRegex(ValueError, "concurrent_groups=False"):
            self.muond(make_params(), concurrent_groups=False)

    def test_tp_partition_dim(self):
        p = torch.zeros(2, 2)
        self.assertIsNone(tp_partition_dim(p))
        p.partition_dim = 0
        self.assertIsNone(tp_partition_dim(p))  # duplicated: tagged but not sharded
        p.tensor_model_parallel = True
        p.partition_dim = 1
        self.assertEqual(tp_partition_dim(p), 1)


@unittest.skipUnless(HAVE_MEGATRON, "megatron-core is not installed")
class FactoryRefusalTest(unittest.TestCase):
    def test_refuses_the_layer_wise_optimizer(self):
        for fields in (dict(optimizer="dist_muon"),
                       dict(optimizer="muon", use_layer_wise_distributed_optimizer=True)):
            with self.subTest(**fields), self.assertRaisesRegex(ValueError,
                                                                "layer-wise distributed"):
                get_megatron_optimizer(OptimizerConfig(lr=1e-3, **fields), [])

    def test_other_optimizers_are_megatrons_call(self):
        """A drop-in import: optimizer='adam' goes to Megatron's factory
        unchanged (the same call, the same error for no model chunks)."""
        from megatron.core.optimizer import get_megatron_optimizer as megatron_factory
        config = OptimizerConfig(optimizer="adam", lr=1e-3)
        with self.assertRaises(Exception) as megatron_error:
            megatron_factory(config, [])
        with self.assertRaises(type(megatron_error.exception)) as ours:
            get_megatron_optimizer(config, [])
        self.assertEqual(str(ours.exception), str(megatron_error.exception))

    def test_registry_restored_when_megatron_raises(self):
        entry = _EMERGING_OPTIMIZERS["muon"]
        with self.assertRaises(Exception):
            get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3), [])
        self.assertIs(_EMERGING_OPTIMIZERS["muon"], entry)


if __name__ == "__main__":
    unittest.main()
