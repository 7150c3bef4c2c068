"""Mistakes a new user makes get an error naming the real cause and the fix,
at once and before anything is applied: a trainer world that differs from
muond launch's daemons, a sparse grad, a hyperparameter of the wrong type
(a bool in any form is no number; a bool option takes every form of bool),
a bias or norm weight among plain params (its own AdamW group) or in an
explicit Muon group (refused naming the AdamW group to put it in),
an LR scheduler cycling momentum over mixed Muon + AdamW groups, a forked
child stepping its parent's optimizer, a step the daemons answer as a replay
of a step this optimizer never sent, and muond.torch imported without torch."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from unittest import mock

import grpc
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_daemon import start_cluster  # noqa: E402
from muond.torch import Muon, MuondError  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from muond.torch import discovery as D  # noqa: E402


def launched(nproc_per_node, world, rank, nnodes=1):
    """The environment muond launch and torchrun give a trainer rank."""
    return {"MUOND_NNODES": str(nnodes), "MUOND_NPROC_PER_NODE": str(nproc_per_node),
            "MUOND_JOB_ID": "job", "MUOND_SOCKET_DIR": "/nonexistent-muond-test",
            "WORLD_SIZE": str(world), "RANK": str(rank)}


class TrainerWorldTest(unittest.TestCase):
    def test_more_daemons_than_trainers_names_both_and_the_fix(self):
        with self.assertRaises(ValueError) as caught:
            D.discover(None, launched(nproc_per_node=4, world=2, rank=0))
        message = str(caught.exception)
        self.assertIn("the daemons' world size is 4", message)
        self.assertIn("runs 2 trainer ranks ($WORLD_SIZE=2)", message)
        self.assertIn("daemon ranks 2-3 waiting for trainers", message)
        self.assertIn("the same --nproc-per-node", message)

    def test_a_trainer_rank_without_a_daemon_names_the_rank(self):
        with self.assertRaises(ValueError) as caught:
            D.discover(None, launched(nproc_per_node=2, world=4, rank=3))
        message = str(caught.exception)
        self.assertIn("trainer rank 3 >= the daemons' world size 2", message)
        self.assertIn("the same --nproc-per-node", message)
        self.assertNotIn("MUOND_JOB_ID", message)

    def test_fewer_daemons_than_trainers_names_the_ranks_without_one(self):
        with self.assertRaisesRegex(ValueError, r"world size is 2 .* runs 4 trainer ranks .*"
                                    r"trainer ranks 2-3 without a daemon"):
            D.discover(None, launched(nproc_per_node=2, world=4, rank=0))

    def test_matching_worlds_and_no_launcher_pass(self):
        env = launched(nproc_per_node=2, world=4, rank=3, nnodes=2)
        self.assertTrue(D.discover(None, env).address.endswith("muond-job-3.sock"))
        bare = {k: v for k, v in env.items() if not k.startswith("MUOND_N")}
        self.assertTrue(D.discover(None, bare).address.endswith("muond-job-3.sock"))

    def test_muon_refuses_before_waiting_for_a_daemon(self):
        w = torch.nn.Parameter(torch.zeros(4, 4))
        with mock.patch.dict(os.environ, launched(nproc_per_node=4, world=2, rank=1)):
            with self.assertRaisesRegex(ValueError, r"world size is 4 .* 2 trainer ranks"):
                Muon([{"params": [w], "param_names": ["w"]}], wait_healthy_timeout=60)


class DaemonWorldTest(unittest.TestCase):
    """Without muond launch's environment the daemon's GetStatus names its
    world size: local mode (one trainer per daemon) checks it before
    registering instead of waiting for a plan that needs every trainer."""

    def muon_on_daemon_0(self, daemons, env):
        directory = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        cluster, addresses = start_cluster(directory, daemons)
        for d in cluster.daemons:
            self.addCleanup(d.stop)
        w = torch.nn.Parameter(torch.zeros(4, 4))
        keys = ("WORLD_SIZE", "SLURM_NTASKS", "MUOND_NNODES", "MUOND_NPROC_PER_NODE")
        clean = {k: v for k, v in os.environ.items() if k not in keys}
        with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
            opt = Muon([{"params": [w], "param_names": ["w"]}], daemons=addresses[:1],
                       job_id="fake", shard_mode="local", wait_healthy_timeout=60)
        opt.close()

    def test_a_daemon_world_larger_than_the_trainers_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"world size is 4 \(daemon rank 0's "
                                    r"--world_size\) but this job runs 2 trainer ranks "
                                    r"\(\$WORLD_SIZE=2\); daemon ranks 2-3 waiting for trainers"):
            self.muon_on_daemon_0(4, {"WORLD_SIZE": "2"})
        with self.assertRaisesRegex(ValueError, r"world size is 2 .* runs 1 trainer rank "):
            self.muon_on_daemon_0(2, {})

    def test_a_matching_daemon_world_registers(self):
        self.muon_on_daemon_0(1, {})
        self.muon_on_daemon_0(2, {"WORLD_SIZE": "2"})


class FakeDaemonCase(unittest.TestCase):
    def setUp(self):
        directory = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
        self.cluster, self.addresses = start_cluster(directory, 1)
        for d in self.cluster.daemons:
            self.addCleanup(d.stop)
        g = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(6, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(4, generator=g))

    def muon(self, adamw=None, **kwargs):
        opt = Muon([{"params": [self.w], "param_names": ["w"]},
                    {"params": [self.b], "param_names": ["b"], "algorithm": "adamw",
                     **(adamw or {})}],
                   daemons=self.addresses, job_id="fake", **{"lr": 0.01, **kwargs})
        self.addCleanup(opt.close)
        return opt

    def set_grads(self):
        for p in (self.w, self.b):
            p.grad = torch.ones_like(p)

    def assert_step_refused(self, opt, error, pattern):
        before = [self.w.detach().clone(), self.b.detach().clone()]
        step_id = opt.step_id
        with self.assertRaisesRegex(error, pattern):
            opt.step()
        self.assertEqual(opt.step_id, step_id)
        self.assertTrue(torch.equal(self.w, before[0]) and torch.equal(self.b, before[1]))


class SparseGradTest(FakeDaemonCase):
    def test_a_sparse_grad_is_refused_naming_the_param(self):
        opt = self.muon()
        self.set_grads()
        self.b.grad = torch.ones(4).to_sparse()
        self.assert_step_refused(opt, RuntimeError,
                                 r"param b: its grad is sparse .*need dense gradients")
        self.b.grad = None
        opt.step()  # dense again: steps
        self.assertEqual(opt.step_id, 1)

    def test_an_embeddings_sparse_grad_in_a_muon_group(self):
        emb = torch.nn.Embedding(6, 4, sparse=True)
        with torch.no_grad():
            self.w.copy_(emb.weight)
        emb.weight = self.w
        opt = self.muon()
        emb(torch.tensor([0, 2])).sum().backward()
        self.assertTrue(self.w.grad.is_sparse)
        self.assert_step_refused(opt, RuntimeError, r"param w: .*sparse=False")


class HyperparameterTypeTest(FakeDaemonCase):
    def test_numbers_given_as_strings_are_refused_at_construction(self):
        cases = [(dict(lr="0.02"), r"group 0 .*'lr' must be a finite real number, got '0.02'"),
                 (dict(momentum="0.9"), r"'momentum' must be a finite real number"),
                 (dict(weight_decay=None), r"'weight_decay' must be a finite real number"),
                 (dict(eps="1e-7"), r"group 0 .*'eps' must be a finite real number"),
                 (dict(ns_steps="5"), r"'ns_steps' must be an int, got '5' \(str\)"),
                 (dict(ns_steps=5.0), r"'ns_steps' must be an int, got 5.0 \(float\)"),
                 (dict(ns_batch_size="auto"),
                  r"'ns_batch_size' must be an int \(0 is auto\), got 'auto' \(str\)"),
                 (dict(ns_batch_size=2**31), r"group 0 .*'ns_batch_size' is 2147483648, "
                                             r"past the int32"),
                 (dict(ns_steps=-2**31 - 1), r"group 0 .*'ns_steps' is -2147483649, past"),
                 (dict(adamw={"betas": ("0.9", 0.99)}), r"group 1 .*'betas'"),
                 (dict(adamw={"eps": "1e-8"}), r"group 1 .*'eps' must be a finite real")]
        for kwargs, pattern in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, pattern):
                    self.muon(**kwargs)

    def test_a_bool_in_any_form_is_not_a_number(self):
        cases = [(dict(lr=True), "lr", 0), (dict(lr=np.True_), "lr", 0),
                 (dict(lr=torch.tensor(True)), "lr", 0), (dict(momentum=np.False_), "momentum", 0),
                 (dict(eps=np.True_), "eps", 0), (dict(ns_steps=np.True_), "ns_steps", 0),
                 (dict(ns_steps=torch.tensor(True)), "ns_steps", 0),
                 (dict(adamw={"betas": (np.True_, 0.99)}), "betas", 1),
                 (dict(adamw={"lr": torch.tensor(True)}), "lr", 1)]
        for kwargs, key, gi in cases:
            with self.subTest(kwargs=kwargs):
                rule = "an int" if key == "ns_steps" else "a finite real number"
                with self.assertRaisesRegex(ValueError, rf"group {gi} .*'{key}' must be {rule}, "
                                            r"got .* \(\w+, a bool: give the number itself\)"):
                    self.muon(**kwargs)

    def test_a_bool_option_takes_every_bool_form(self):
        for value in (True, np.False_, torch.tensor(False), np.True_, torch.tensor(True), 0):
            with self.subTest(value=value):
                daemon = self.cluster.daemons[0]
                opt = self.muon(nesterov=value, use_syrk=value, double_buffer_momentum=value)
                self.set_grads()
                opt.step()
                registered = daemon.requests[-1].groups[0].muon
                self.assertEqual((registered.nesterov, registered.use_syrk,
                                  registered.double_buffer_momentum), (bool(value),) * 3)
                (override,) = [o for o in daemon.step_requests[-1].overrides if o.group == "group0"]
                self.assertIs(override.nesterov, bool(value))
                opt.close()

    def test_an_adamw_group_refuses_double_buffer_momentum(self):
        with self.assertRaisesRegex(ValueError, r"param group 1: 'double_buffer_momentum' is an "
                                                r"option of a Muon group's momentum"):
            self.muon(adamw={"double_buffer_momentum": True})

    def test_a_bool_option_refuses_what_is_no_bool(self):
        for value in ("yes", 2, 0.0, torch.tensor([True, False])):
            with self.subTest(value=value):
                with self.assertRaisesRegex(ValueError, r"group 0 .*'nesterov' must be a bool "
                                            r"\(True or False; a numpy bool_ or a one-element "
                                            r"bool tensor too\)"):
                    self.muon(nesterov=value)
                with self.assertRaisesRegex(ValueError, r"'use_syrk' must be a bool"):
                    self.muon(use_syrk=value)
                with self.assertRaisesRegex(ValueError,
                                            r"'double_buffer_momentum' must be a bool"):
                    self.muon(double_buffer_momentum=value)

    def test_a_string_set_in_param_groups_is_refused_at_step(self):
        opt = self.muon()
        self.set_grads()
        opt.step()
        for key, gi, value in (("lr", 0, "0.01"), ("betas", 1, (0.9, "0.99"))):
            with self.subTest(key=key):
                good = opt.param_groups[gi][key]
                opt.param_groups[gi][key] = value
                self.assert_step_refused(opt, ValueError, rf"group {gi} .*'{key}'")
                opt.param_groups[gi][key] = good
        opt.step()
        self.assertEqual(opt.step_id, 2)


class CycledMomentumTest(FakeDaemonCase):
    def run_one_cycle(self, opt, **scheduler_options):
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=8,
                                                    **scheduler_options)
        for _ in range(4):
            self.set_grads()
            opt.step()
            sched.step()

    def test_mixed_groups_name_cycle_momentum(self):
        opt = self.muon()
        with self.assertRaisesRegex(ValueError, r"group 1 .*'momentum' changed.*adamw group "
                                    r"does not use 'momentum'.*OneCycleLR.*"
                                    r"cycle_momentum=False"):
            self.run_one_cycle(opt)

    def test_mixed_groups_step_with_cycle_momentum_false(self):
        opt = self.muon()
        self.run_one_cycle(opt, cycle_momentum=False)
        self.assertEqual(opt.step_id, 4)

    def test_a_muon_groups_momentum_is_cycled_live(self):
        opt = Muon([{"params": [self.w], "param_names": ["w"]}], lr=0.01,
                   daemons=self.addresses, job_id="fake")
        self.addCleanup(opt.close)
        self.run_one_cycle(opt)
        self.assertEqual(opt.step_id, 4)
        self.assertLess(opt.param_groups[0]["momentum"], 0.95)


class NonMatrixParamTest(FakeDaemonCase):
    """README's one line, Muon(model.named_parameters()), on a model with
    biases and norm weights: the 2-D params form a Muon group, the others
    an AdamW group; in explicit groups a non-2-D Muon param is refused
    naming it and the AdamW group to put it in."""

    def model(self):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4),
                                   torch.nn.Linear(4, 3, bias=False))

    def plain(self, params, **kwargs):
        opt = Muon(params, daemons=self.addresses, job_id="fake", lr=0.01, **kwargs)
        self.addCleanup(opt.close)
        return opt

    def test_named_parameters_split_into_muon_and_adamw_groups(self):
        model = self.model()
        opt = self.plain(model.named_parameters(), weight_decay=0.05)
        muon, adamw = opt.param_groups
        self.assertEqual((muon["algorithm"], muon["param_names"]),
                         ("muon", ["0.weight", "2.weight"]))
        self.assertEqual((adamw["algorithm"], adamw["param_names"]),
                         ("adamw", ["0.bias", "1.weight", "1.bias"]))
        self.assertEqual((adamw["lr"], adamw["weight_decay"], adamw["betas"], adamw["eps"]),
                         (0.01, 0.05, (0.9, 0.95), 1e-8))
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        self.assertEqual(opt.step_id, 1)

    def test_parameters_split_alike_and_matrices_alone_stay_one_group(self):
        model = self.model()
        opt = self.plain(model.parameters())
        self.assertEqual([(g["algorithm"], len(g["params"])) for g in opt.param_groups],
                         [("muon", 2), ("adamw", 3)])
        opt.close()
        matrices = self.plain([model[0].weight, model[2].weight])
        self.assertEqual([g["algorithm"] for g in matrices.param_groups], ["muon"])

    def test_only_non_matrix_params_make_one_adamw_group(self):
        norm = torch.nn.LayerNorm(4)
        opt = self.plain(norm.named_parameters())
        self.assertEqual([(g["algorithm"], g["param_names"]) for g in opt.param_groups],
                         [("adamw", ["weight", "bias"])])

    def test_a_non_matrix_param_in_an_explicit_muon_group_names_the_adamw_group(self):
        with self.assertRaises(ValueError) as caught:
            self.plain([{"params": [self.w, self.b], "param_names": ["w", "b"]}])
        message = str(caught.exception)
        self.assertIn("param b: Muon params must be matrices (2-D) or batches of matrices "
                      "([..., m, n], e.g. [experts, m, n]): Newton-Schulz orthogonalises "
                      "matrices, and a param of shape (4,) has none", message)
        self.assertIn('Put it in an AdamW group: {"params": [p for p in model.parameters() '
                      'if p.ndim < 2], "algorithm": "adamw"}', message)
        self.assertIn("or pass model.named_parameters() itself", message)


class ForkedChildTest(FakeDaemonCase):
    """A forked child's copy of the optimizer shares the parent's
    registration and step ids: it is refused before anything is sent, and
    the parent's next step is a real step, not a replay."""

    def in_forked_child(self, call) -> str:
        """call() in a forked child; what it raised ("" if nothing)."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never run the test runner's code
            os.close(read)
            try:
                call()
                said = ""
            except BaseException as e:  # noqa: BLE001 (reported to the parent)
                said = f"{type(e).__name__}: {e}"
            os.write(write, said.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            said = f.read()
        os.waitpid(pid, 0)
        return said

    def test_step_load_and_add_group_in_a_forked_child_are_refused(self):
        opt = self.muon()
        self.set_grads()
        opt.step()
        state = opt.state_dict()
        extra = torch.nn.Parameter(torch.zeros(3))
        for what, call in (("step()", opt.step),
                           ("load_state_dict()", lambda: opt.load_state_dict(state)),
                           ("add_param_group()", lambda: opt.add_param_group(
                               {"params": [extra], "param_names": ["extra"],
                                "algorithm": "adamw"}))):
            with self.subTest(what=what):
                said = self.in_forked_child(call)
                self.assertRegex(said, rf"RuntimeError: muond.torch.Muon.{re.escape(what)} "
                                 r"called in process \d+, but this optimizer was made in "
                                 rf"process {os.getpid()}: this process is a fork")
                self.assertIn("Make the optimizer in this process", said)
        before = self.w.detach().clone()
        self.set_grads()
        opt.step()  # the parent's step is applied: no child stepped in its name
        self.assertEqual(opt.step_id, 2)
        self.assertFalse(torch.equal(self.w, before))
        self.assertFalse(any(r.replayed for r in opt.last_responses))


class ReplayedStepTest(FakeDaemonCase):
    """A daemon answers a step id it applied already as a replay: accepted
    for a resend of a step whose answer was lost, refused for any other."""

    def test_a_replay_of_a_step_never_sent_is_refused(self):
        opt = self.muon()
        daemon = self.cluster.daemons[0]
        daemon.on_step = lambda request, context: pb.StepResponse(step_id=request.step_id,
                                                                  replayed=True)
        self.set_grads()
        for _ in range(2):  # and stays refused: the id never advances past it
            with self.assertRaisesRegex(RuntimeError, r"answered step 1 from their record .*"
                                        r"never sent step 1 before: another process stepped "
                                        r"its registration .*Build a new optimizer"):
                opt.step()
            self.assertEqual(opt.step_id, 0)

    def test_a_replay_of_a_resent_step_is_its_answer(self):
        opt = self.muon()
        daemon = self.cluster.daemons[0]
        answers = iter(["lost", "replayed"])

        def applied_then_lost(request, context):
            if next(answers) == "lost":
                context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost")
            return pb.StepResponse(step_id=request.step_id, replayed=True)

        daemon.on_step = applied_then_lost
        self.set_grads()
        with self.assertRaises(MuondError):
            opt.step()
        self.assertEqual(opt.step_id, 0)
        opt.step()  # the same id again: the daemon's record answers it
        self.assertEqual(opt.step_id, 1)
        self.assertEqual([r.step_id for r in daemon.step_requests], [1, 1])


class ImportWithoutTorchTest(unittest.TestCase):
    def test_import_names_the_extra_to_install(self):
        # Makes torch unimportable in a fresh interpreter, as on a machine
        # where only `pip install muond` ran.
        code = textwrap.dedent("""
            import sys
            class NoTorch:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch" or name.startswith("torch."):
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            sys.meta_path.insert(0, NoTorch())
            try:
                import muond.torch
            except ImportError as e:
                print("ImportError:", e)
        """)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("ImportError: muond.torch needs PyTorch", out.stdout)
        self.assertIn("pip install 'muond[torch]'", out.stdout)


if __name__ == "__main__":
    unittest.main()
