"""muond.torch.Muon's usual step sent before its checks (``overlap_checks``,
the default, through a real host daemon's step channel): the daemon waits,
ready to commit, for the trainer's verdict. Steps so are bitwise the steps
checked first; a grad moved since the last step, or a param frozen, is
withdrawn (nothing applied) and sent again after the checks, bitwise as
without the overlap; a check that refuses raises its error, changes nothing,
and the same step goes through once the cause is undone; the Step RPC
refuses a step that asks for a verdict. Two ranks: one rank's withdrawal is
sent again by both, and one rank's refusing check fails the step on both at
once (not after the communicator timeout), each with the same result as a
run without them."""
import gc
import os
import sys
import unittest
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
sys.path.insert(0, HERE)

import grpc  # noqa: E402
import torch  # noqa: E402

import trainer_procs  # noqa: E402
from cluster import ClusterTestCase, find_binaries  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from muond.torch import Muon  # noqa: E402

STEPS = 6
HYPER = dict(lr=0.02, weight_decay=0.1)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def backward(model, step):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()


def count_paths(opt) -> dict:
    """How each step() went: sent before its checks and applied ("overlapped"),
    or withdrawn / not sent so ("withdrawn"); counted at the client."""
    counts = {"overlapped": 0, "withdrawn": 0}
    client = opt.clients[0]
    real = client.step_with_checks

    def counted(*args, **kw):
        try:
            response = real(*args, **kw)
        except Exception:
            counts["withdrawn"] += 1
            raise
        counts["overlapped" if response is not None else "withdrawn"] += 1
        return response
    client.step_with_checks = counted
    return counts


class OverlapChecksTest(ClusterTestCase):
    def muon(self, model, **kw):
        opt = Muon(model.named_parameters(), daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, rpc_timeout=60, **HYPER, **kw)
        self.addCleanup(opt.close)
        return opt

    def train(self, overlap, tamper=None, set_to_none=False):
        """STEPS steps (``tamper(step, model, opt)`` before each step()); the
        final params and how the steps went."""
        model = make_model()
        opt = self.muon(model, overlap_checks=overlap)
        counts = count_paths(opt)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            backward(model, step)
            if tamper is not None:
                tamper(step, model, opt)
            opt.step()
        self.assertEqual(opt.step_id, STEPS)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()
        return params, counts

    def assert_bitwise(self, got, want):
        for name, w in want.items():
            self.assertTrue(torch.equal(got[name], w), name)

    def test_overlapped_steps_are_the_checked_steps_bitwise(self):
        want, counts = self.train(False)
        self.assertEqual(counts, {"overlapped": 0, "withdrawn": 0})
        got, counts = self.train(True)
        self.assert_bitwise(got, want)
        # The first step is checked first (nothing sent yet to guess the
        # skipped params from); every later one overlaps.
        self.assertEqual(counts, {"overlapped": STEPS - 1, "withdrawn": 0})

    def test_grads_set_to_none_never_overlap_and_never_withdraw(self):
        # zero_grad()'s default: backward makes new grads every step, which
        # step() copies in first; the overlap would only be withdrawn.
        want, _ = self.train(False, set_to_none=True)
        got, counts = self.train(True, set_to_none=True)
        self.assert_bitwise(got, want)
        self.assertEqual(counts, {"overlapped": 0, "withdrawn": 0})

    def test_a_moved_grad_is_withdrawn_then_sent_after_the_checks(self):
        def move(step, model, opt):
            if step == 2:  # the same values, in other memory: copied in
                model[2].weight.grad = model[2].weight.grad.clone()
        want, _ = self.train(False, move)
        got, counts = self.train(True, move)
        self.assert_bitwise(got, want)
        # Step 3 withdrawn; step 4 checked first (step 3's grads were not in
        # place); steps 2, 5 and 6 overlapped.
        self.assertEqual(counts, {"overlapped": STEPS - 3, "withdrawn": 1})

    def test_a_frozen_first_param_still_overlaps(self):
        # A frozen embedding or LoRA base weight first: the step goes before
        # its checks all the same, bitwise as checked first.
        def train(overlap):
            model = make_model()
            model[0].weight.requires_grad_(False)
            opt = self.muon(model, overlap_checks=overlap)
            counts = count_paths(opt)
            for step in range(STEPS):
                opt.zero_grad(set_to_none=False)
                backward(model, step)
                opt.step()
            out = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.close()
            return out, counts
        want, _ = train(False)
        got, counts = train(True)
        self.assert_bitwise(got, want)
        self.assertEqual(counts, {"overlapped": STEPS - 1, "withdrawn": 0})

    def test_a_withdrawn_step_leaves_no_reference_cycle(self):
        # Reference counting alone ends the optimizer (as test_optimizer_lifetime
        # asks of every step): the withdrawal's errors hold no frame that
        # holds it.
        gc.disable()
        self.addCleanup(gc.enable)
        model = make_model()
        opt = Muon(model.named_parameters(), daemons=self.cluster.daemons,
                   job_id=self.cluster.job_id, rpc_timeout=60, **HYPER)
        counts = count_paths(opt)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            backward(model, step)
            if step == 2:
                model[2].weight.grad = model[2].weight.grad.clone()
            opt.step()
        self.assertEqual(counts["withdrawn"], 1)
        opt.clients[0].step_with_checks = None  # count_paths' wrapper holds the client
        gone = weakref.ref(opt)
        opt.close()
        del opt
        self.assertIsNone(gone(), "the optimizer outlived its last reference (a cycle?)")

    def test_a_frozen_param_is_withdrawn_then_skipped(self):
        def freeze(step, model, opt):
            if step == 2:
                model[2].weight.grad = None  # torch.optim's skip
        want, _ = self.train(False, freeze)
        got, counts = self.train(True, freeze)
        self.assert_bitwise(got, want)
        # Step 3 withdrawn; step 4 checked first (zero_grad bound the grad
        # again, but step 3's were not in place); 2, 5 and 6 overlapped.
        self.assertEqual(counts, {"overlapped": STEPS - 3, "withdrawn": 1})

    def test_a_refused_check_changes_nothing_and_the_step_goes_again(self):
        model = make_model()
        opt = self.muon(model)
        counts = count_paths(opt)
        for step in range(2):
            opt.zero_grad(set_to_none=False)
            backward(model, step)
            opt.step()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        kept = opt.param_groups[0]["ns_steps"]
        opt.param_groups[0]["ns_steps"] = kept + 2  # a fixed entry
        with self.assertRaisesRegex(ValueError, "ns_steps"):
            opt.step()
        self.assertEqual(counts["withdrawn"], 1)
        self.assertEqual(opt.step_id, 2)
        self.assert_bitwise({n: p.detach() for n, p in model.named_parameters()}, before)
        opt.param_groups[0]["ns_steps"] = kept
        opt.step()  # checked first: a withdrawn step's next attempt is
        self.assertEqual(opt.step_id, 3)
        self.assertEqual(counts, {"overlapped": 1, "withdrawn": 1})
        opt.step()
        self.assertEqual(counts, {"overlapped": 2, "withdrawn": 1})

    def test_a_bad_hyperparameter_is_named_as_when_checked_first(self):
        model = make_model()
        opt = self.muon(model)
        for step in range(2):
            opt.zero_grad(set_to_none=False)
            backward(model, step)
            opt.step()
        lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = "abc"
        with self.assertRaisesRegex(ValueError, "'lr' must be a finite real number"):
            opt.step()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        self.assertEqual(opt.step_id, 3)

    def test_a_refusal_from_memory_the_checks_would_change_is_withdrawn(self):
        # The shared grad holds NaN and the param's grad moved to finite values:
        # the daemon, reading the shared grad before the verdict, would refuse
        # the step as non-finite; the withdrawal outranks that, and the step
        # sent again after the checks copies the finite grad in.
        def stale_nan(step, model, opt):
            if step == 2:
                grad = model[2].weight.grad
                finite = grad.clone()
                grad.fill_(float("nan"))
                model[2].weight.grad = finite
        want, _ = self.train(False, stale_nan)
        got, counts = self.train(True, stale_nan)
        self.assert_bitwise(got, want)
        self.assertEqual(counts, {"overlapped": STEPS - 3, "withdrawn": 1})

    def test_the_option_must_be_a_bool(self):
        with self.assertRaisesRegex(ValueError, "overlap_checks must be a bool, got 'yes'"):
            Muon(make_model().parameters(), daemons=self.cluster.daemons,
                 job_id=self.cluster.job_id, overlap_checks="yes")

    def test_the_step_rpc_refuses_a_step_that_asks_for_a_verdict(self):
        model = make_model()
        opt = self.muon(model)
        opt.zero_grad(set_to_none=False)
        backward(model, 0)
        opt.step()
        client = opt.clients[0]
        request = pb.StepRequest(job_id=self.cluster.job_id, step_id=2,
                                 client_id=opt.client_id, optimizer=client.optimizer or "",
                                 await_trainer_verdict=True)
        with self.assertRaises(grpc.RpcError) as caught:
            client.stub.Step(request, timeout=60)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                         caught.exception.details())
        self.assertIn("await_trainer_verdict", caught.exception.details())
        self.assertIn("step channel", caught.exception.details())
        opt.step()  # nothing was applied: step 2 goes through
        self.assertEqual(opt.step_id, 2)


WORLD = 2
WITHDRAWING_RANK = 1


def _trainer(rank, tmp, mode, overlap=True):
    """``mode``: "clean"; "move" (rank 1 moves a grad before step 3); "refuse"
    (rank 1 edits a fixed group entry before step 3, then puts it back and
    both send step 3 again); "freeze" (both skip a param at step 3, and rank
    0 reads its state first, so it checks first while rank 1 overlaps);
    "withdraw_refuse" (before step 3 rank 0 moves a grad, so it withdraws,
    and rank 1 sets a bad lr, so it refuses; then rank 1 puts it back and
    both send step 3 again)."""
    trainer_procs.join_job(rank, tmp, WORLD)
    import torch.distributed as dist
    from muond.client import MuondError
    from muond.torch import Muon
    model = make_model()  # the same params and grads on both ranks: replicas
    opt = Muon(model.named_parameters(), rpc_timeout=120, overlap_checks=overlap, **HYPER)
    counts = count_paths(opt)
    out = {"errors": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        backward(model, step)
        if rank == WITHDRAWING_RANK and step == 2:
            if mode == "move":  # not the first param: see first_grad_in_place
                model[2].weight.grad = model[2].weight.grad.clone()
            if mode == "refuse":
                opt.param_groups[0]["ns_steps"] += 2
        if mode == "withdraw_refuse" and step == 2:
            if rank == 0:
                model[2].weight.grad = model[2].weight.grad.clone()
            else:
                opt.param_groups[0]["lr"] = "abc"
        if mode == "freeze" and step == 2:
            model[2].weight.grad = None
            if rank == 0:
                opt.state[model[0].weight]  # noqa: B018 (read: it may be pushed first)
        if mode in ("refuse", "withdraw_refuse") and step == 2:
            try:
                opt.step()
                out["errors"].append(None)
            except (ValueError, MuondError) as e:
                out["errors"].append((type(e).__name__, str(e), getattr(e, "reason", None)))
            out["step_id_after_refusal"] = opt.step_id
            if rank == WITHDRAWING_RANK and mode == "refuse":
                opt.param_groups[0]["ns_steps"] -= 2
            if rank == 1 and mode == "withdraw_refuse":
                opt.param_groups[0]["lr"] = HYPER["lr"]
        opt.step()
    out.update(final={n: p.detach().clone() for n, p in model.named_parameters()},
               counts=counts, channel=opt.uses_step_channel)
    opt.close()
    trainer_procs.save_result(tmp, rank, out)
    dist.destroy_process_group()


def _run_job(mode: str, overlap: bool = True) -> list:
    # A withdrawal or refusal that waited for the communicator would take
    # 600 s: far beyond the harness's join timeout.
    return trainer_procs.run_job(_trainer, (mode, overlap), WORLD, "muond-overlap-", 600)


class TwoRankWithdrawalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.clean = _run_job("clean")

    def assert_clean(self, runs, clean=None):
        for r in range(WORLD):
            self.assertTrue(runs[r]["channel"], f"rank {r}")
            for n, want in (clean or self.clean)[r]["final"].items():
                self.assertTrue(torch.equal(runs[r]["final"][n], want), f"{n} on rank {r}")

    def test_one_ranks_withdrawal_is_sent_again_by_every_rank(self):
        runs = _run_job("move")
        self.assert_clean(runs)
        for r in range(WORLD):
            self.assertEqual(self.clean[r]["counts"], {"overlapped": STEPS - 1, "withdrawn": 0})
        # Rank 1 withdrew step 3; rank 0 had said go, was answered
        # STEP_WITHDRAWN and sent it again after its checks. At step 4 rank 1
        # checks first (its grads were not in place) while rank 0 overlaps.
        self.assertEqual(runs[WITHDRAWING_RANK]["counts"],
                         {"overlapped": STEPS - 3, "withdrawn": 1})
        self.assertEqual(runs[1 - WITHDRAWING_RANK]["counts"],
                         {"overlapped": STEPS - 2, "withdrawn": 1})

    def test_a_rank_checking_first_beside_one_overlapping_agrees_on_skips(self):
        runs = _run_job("freeze")
        self.assert_clean(runs, _run_job("freeze", overlap=False))
        for r in range(WORLD):
            self.assertEqual(runs[r]["errors"], [], f"rank {r}")
        # Rank 1 sent step 3 with step 2's skip list, which rank 0's domain
        # agreement refused; rank 1's withdrawal outranked that refusal.
        self.assertEqual(runs[1]["counts"]["withdrawn"], 1)

    def test_a_peers_refusal_outranks_a_withdrawal(self):
        # Rank 0 withdrew step 3 and rank 1's trainer refused it: rank 1 sends
        # no step again, so rank 0 is told at once, not after a timeout.
        runs = _run_job("withdraw_refuse")
        kind, message, _ = runs[1]["errors"][0]
        self.assertEqual(kind, "ValueError")
        self.assertIn("'lr'", message)
        kind, message, reason = runs[0]["errors"][0]
        self.assertEqual((kind, reason), ("MuondError", "TRAINER_REFUSED"), message)
        self.assertIn("rank 1", message)
        self.assertEqual(runs[0]["counts"]["withdrawn"], 1)  # rank 0 went first
        for r in range(WORLD):
            self.assertEqual(runs[r]["step_id_after_refusal"], 2, f"rank {r}")
        self.assert_clean(runs)

    def test_a_check_that_refuses_fails_the_step_on_every_rank_at_once(self):
        runs = _run_job("refuse")
        kind, message, _ = runs[WITHDRAWING_RANK]["errors"][0]
        self.assertEqual(kind, "ValueError")
        self.assertIn("ns_steps", message)
        kind, message, reason = runs[1 - WITHDRAWING_RANK]["errors"][0]
        self.assertEqual((kind, reason), ("MuondError", "TRAINER_REFUSED"), message)
        self.assertIn(f"rank {WITHDRAWING_RANK}", message)
        for r in range(WORLD):
            self.assertEqual(runs[r]["step_id_after_refusal"], 2, f"rank {r}")
        self.assert_clean(runs)  # the refused step left no trace


if __name__ == "__main__":
    unittest.main()
