"""FSDP2 params stored in muond's shared param buffer (muond.torch.fsdp2_storage),
one gloo rank, FSDP2 over it, a fake daemon:

* after registration FSDP2's flat shard and the param's local tensor are views
  of the buffer (no second copy; the all-gather reads what the daemon wrote);
* ``load_state_dict(..., assign=True)`` (with swap_tensors, which keeps the
  Parameter objects) makes FSDP2 re-point the params at the loaded tensors;
  the next step takes the new values back into the buffer and steps them,
  bitwise as a load that copies in place;
* the same load without swap_tensors (new Parameter objects in the module,
  which FSDP2 follows) is refused at the next step, naming the params, with
  nothing changed;
* an assign load of the model's own state_dict tensors under other keys
  (views of the buffer, whose one storage FSDP2 would take for the param's
  own flat shard) steps bitwise as the copy path;
* ``zero_grad(set_to_none=False)`` gives each param a grad over the shared
  grad buffer, which FSDP2's reduce-scatter accumulates into: bitwise as the
  copied grads of ``set_to_none=True``;
* a param FSDP2 keeps in a form muond does not bind (CPU offload, a tensor
  subclass, ...) steps through the copy path, bitwise as a bound one.
"""
import os
import shutil
import socket
import sys
import tempfile
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fake_daemon  # noqa: E402

HYPER = dict(lr=0.02, weight_decay=0.1)
STEPS = 2


def setUpModule():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def tearDownModule():
    dist.destroy_process_group()


def _model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _groups(model):
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if p.ndim == 2]},
            {"params": [(n, p) for n, p in named if p.ndim != 2], "algorithm": "adamw",
             "lr": 3e-3}]


def _train_step(model, opt, step, set_to_none=True):
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
    opt.zero_grad(set_to_none=set_to_none)
    model(x).pow(2).mean().backward()
    opt.step()


def _full(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


class Fsdp2StorageTest(fake_daemon.FakeClusterTestCase):
    def setUp(self):
        super().setUp()
        self.clusters = {}  # id(optimizer) -> its fake cluster

    def in_buffer(self, opt, model):
        storages = {b.flat.untyped_storage().data_ptr() for b in opt._buffers}
        return {n: p.to_local().untyped_storage().data_ptr() in storages
                for n, p in model.named_parameters()}

    def build_on_own_daemon(self, model):
        """A Muon over `model` on a fake daemon of its own (its own state)."""
        from muond.torch import Muon
        directory = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        cluster, addresses = fake_daemon.start_cluster(directory, 1)
        self.addCleanup(lambda: [d.stop() for d in cluster.daemons])
        opt = Muon(_groups(model), daemons=addresses, job_id="fake", shard_mode="local", **HYPER)
        self.addCleanup(opt.close)
        self.clusters[id(opt)] = cluster
        return opt

    def cluster_of(self, opt):
        return self.clusters[id(opt)]

    def test_shards_live_in_the_buffer_and_follow_an_assign_load(self):
        from muond.torch import fsdp2_storage
        model = _model()
        opt = self.build_on_own_daemon(model)
        _train_step(model, opt, 0)
        self.assertEqual(set(self.in_buffer(opt, model).values()), {True})
        by_param = fsdp2_storage.fsdp_params()
        for _, p in model.named_parameters():
            flat = by_param[id(p)]._sharded_param_data
            self.assertEqual(flat.data_ptr(), p.to_local().data_ptr())

        # The same new values loaded two ways: assign=True (FSDP2 re-points
        # at the loaded tensors; swap_tensors keeps the Parameter objects, as
        # FSDP2 expects and any optimizer needs) and in place (copied into the
        # buffer).
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        self.addCleanup(torch.__future__.set_swap_module_params_on_conversion, swap)
        model.load_state_dict({n: t * 0.5 for n, t in model.state_dict().items()},
                              assign=True)
        self.assertEqual(set(self.in_buffer(opt, model).values()), {False})
        _train_step(model, opt, 1)
        self.assertEqual(set(self.in_buffer(opt, model).values()), {True})

        other = _model()
        opt_other = self.build_on_own_daemon(other)
        _train_step(other, opt_other, 0)
        loaded = {n: t * 0.5 for n, t in other.state_dict().items()}
        before = {n: t.full_tensor().clone() for n, t in loaded.items()}
        other.load_state_dict(loaded)
        _train_step(other, opt_other, 1)
        got = _full(model)
        for n, want in _full(other).items():
            self.assertFalse(torch.equal(want, before[n]), f"{n} never moved")
            self.assertTrue(torch.equal(got[n], want), n)

    def test_an_assign_load_that_replaces_the_parameters_is_refused(self):
        # Without swap_tensors, load_state_dict(assign=True) puts new Parameter
        # objects in the module and FSDP2 follows them: the optimizer's params
        # are no longer the model's (their grads never come). Taking the new
        # params into the buffer would step them with the old params' grads
        # (zeroed in place: momentum and weight decay only); refused instead,
        # naming each param, before anything changes.
        model = _model()
        opt = self.build_on_own_daemon(model)
        _train_step(model, opt, 0, set_to_none=False)
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(False)
        self.addCleanup(torch.__future__.set_swap_module_params_on_conversion, swap)
        model.load_state_dict({n: t * 0.5 for n, t in model.state_dict().items()},
                              assign=True)
        before = _full(model)
        for _ in range(2):  # refused again: nothing was taken in by the first
            with self.assertRaisesRegex(
                    ValueError, r"another Parameter object for param 0\.weight, .*param 2\.bias: "
                    r".*assign=True\) without .*set_swap_module_params_on_conversion\(True\)"):
                _train_step(model, opt, 1, set_to_none=False)
        for n, want in _full(model).items():
            self.assertTrue(torch.equal(before[n], want), n)

    def test_an_assign_load_of_other_params_live_tensors_swaps_them(self):
        # The model's own state_dict tensors loaded under other keys of the
        # same shape with assign=True (swap_tensors on): the loaded tensors are
        # views of muond's param buffer, one storage for every param, which
        # FSDP2 takes for the param's own flat shard (it compares storages) and
        # keeps all-gathering the old values. Bitwise as the copy path, the
        # forward right after the load included.
        from muond.torch import fsdp2_storage
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        self.addCleanup(torch.__future__.set_swap_module_params_on_conversion, swap)

        def square_model():
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                        torch.nn.Linear(6, 6))
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            return model

        def run(model, opt):
            losses = []
            for step in range(3):
                if step == 1:
                    sd = model.state_dict()
                    model.load_state_dict({"0.weight": sd["2.weight"], "2.weight": sd["0.weight"],
                                           "0.bias": sd["2.bias"], "2.bias": sd["0.bias"]},
                                          assign=True)
                x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
                opt.zero_grad(set_to_none=False)
                loss = model(x).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
                opt.step()
            return losses

        bound, copied = square_model(), square_model()
        opt_bound = self.build_on_own_daemon(bound)
        with mock.patch.object(fsdp2_storage, "_bindable", return_value=False):
            opt_copied = self.build_on_own_daemon(copied)
            want_losses = run(copied, opt_copied)
        self.assertEqual(run(bound, opt_bound), want_losses)
        self.assertEqual(set(self.in_buffer(opt_bound, bound).values()), {True})
        got = _full(bound)
        for n, want in _full(copied).items():
            self.assertTrue(torch.equal(got[n], want), n)
        opt_bound.close()  # its load_state_dict hooks go with it
        self.assertEqual([len(bound[i]._load_state_dict_pre_hooks) for i in (0, 2)],
                         [len(copied[i]._load_state_dict_pre_hooks) for i in (0, 2)])

    def test_a_param_fsdp2_keeps_otherwise_takes_the_copy_path_bitwise(self):
        from muond.torch import fsdp2_storage
        bound, copied = _model(), _model()
        opt_bound = self.build_on_own_daemon(bound)
        with mock.patch.object(fsdp2_storage, "_bindable", return_value=False):
            opt_copied = self.build_on_own_daemon(copied)
            for step in range(STEPS):
                _train_step(bound, opt_bound, step)
                _train_step(copied, opt_copied, step)
        self.assertEqual(set(self.in_buffer(opt_bound, bound).values()), {True})
        self.assertEqual(set(self.in_buffer(opt_copied, copied).values()), {False})
        got = _full(copied)
        for n, want in _full(bound).items():
            self.assertTrue(torch.equal(got[n], want), n)

    def test_grads_zeroed_in_place_accumulate_in_the_shared_buffer(self):
        copied, in_place = _model(), _model()
        opt_copied = self.build_on_own_daemon(copied)
        opt_in_place = self.build_on_own_daemon(in_place)
        grads = {b.flat.untyped_storage().data_ptr() for b in opt_in_place._buffers}
        for step in range(STEPS):
            _train_step(copied, opt_copied, step)
            _train_step(in_place, opt_in_place, step, set_to_none=False)
            for n, p in in_place.named_parameters():
                self.assertIn(p.grad.to_local().untyped_storage().data_ptr(), grads, n)
        got = _full(in_place)
        for n, want in _full(copied).items():
            self.assertTrue(torch.equal(got[n], want), n)

    def test_a_dtype_change_is_refused_naming_the_param_before_a_grad_is_bound(self):
        model = _model()
        opt = self.build_on_own_daemon(model)
        _train_step(model, opt, 0, set_to_none=False)
        model.double()
        with self.assertRaisesRegex(ValueError, r"param 0\.weight: .*dtype torch\.float32 -> "
                                                r"torch\.float64"):
            opt.zero_grad(set_to_none=False)
        sent = self.cluster_of(opt).daemons[0].step_requests
        self.assertRegex(sent[-1].trainer_refusal, r"ValueError: .*0\.weight")
        self.assertEqual(opt.step_id, 1)


if __name__ == "__main__":
    unittest.main()
