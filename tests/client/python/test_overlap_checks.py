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
import os
import pickle
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
sys.path.insert(0, HERE)

import grpc  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import trainer_procs  # noqa: E402
from cluster import Cluster, ClusterTestCase, find_binaries  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from muond.torch import Muon  # noqa: E402

STEPS = 4
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

    def train(self, overlap, tamper=None):
        """STEPS steps (``tamper(step, model, opt)`` before each step()); the
        final params and how the steps went."""
        model = make_model()
        opt = self.muon(model, overlap_checks=overlap)
        counts = count_paths(opt)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=False)
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

    def test_a_moved_grad_is_withdrawn_then_sent_after_the_checks(self):
        def move(step, model, opt):
            if step == 2:  # the same values, in other memory: copied in
                model[0].weight.grad = model[0].weight.grad.clone()
        want, _ = self.train(False, move)
        got, counts = self.train(True, move)
        self.assert_bitwise(got, want)
        self.assertEqual(counts, {"overlapped": STEPS - 2, "withdrawn": 1})

    def test_a_frozen_param_is_withdrawn_then_skipped(self):
        def freeze(step, model, opt):
            if step == 2:
                model[2].weight.grad = None  # torch.optim's skip
        want, _ = self.train(False, freeze)
        got, counts = self.train(True, freeze)
        self.assert_bitwise(got, want)
        # Step 3 sends step 2's skip list, which no longer holds: withdrawn.
        self.assertEqual(counts, {"overlapped": STEPS - 3, "withdrawn": 2})

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
        opt.step()
        self.assertEqual(opt.step_id, 3)
        self.assertEqual(counts, {"overlapped": 2, "withdrawn": 1})

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


def _trainer(rank, tmp, mode):
    """``mode``: "clean"; "move" (rank 1 moves a grad before step 3); "refuse"
    (rank 1 edits a fixed group entry before step 3, then puts it back and
    both send step 3 again)."""
    trainer_procs.join_job(rank, tmp, WORLD)
    import torch.distributed as dist
    from muond.client import MuondError
    from muond.torch import Muon
    model = make_model()  # the same params and grads on both ranks: replicas
    opt = Muon(model.named_parameters(), rpc_timeout=120, **HYPER)
    counts = count_paths(opt)
    out = {"errors": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        backward(model, step)
        if rank == WITHDRAWING_RANK and step == 2:
            if mode == "move":
                model[0].weight.grad = model[0].weight.grad.clone()
            if mode == "refuse":
                opt.param_groups[0]["ns_steps"] += 2
        if mode == "refuse" and step == 2:
            try:
                opt.step()
                out["errors"].append(None)
            except (ValueError, MuondError) as e:
                out["errors"].append((type(e).__name__, str(e), getattr(e, "reason", None)))
            out["step_id_after_refusal"] = opt.step_id
            if rank == WITHDRAWING_RANK:
                opt.param_groups[0]["ns_steps"] -= 2
        opt.step()
    out.update(final={n: p.detach().clone() for n, p in model.named_parameters()},
               counts=counts, channel=opt.uses_step_channel)
    opt.close()
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def _run_job(mode: str) -> list:
    tmp = tempfile.mkdtemp(prefix="muond-overlap-")
    ctx = mp.start_processes(_trainer, args=(tmp, mode), nprocs=WORLD, join=False,
                             start_method="fork")
    # A withdrawal or refusal that waited for the communicator would take
    # this long: far beyond the harness's join timeout.
    with Cluster(WORLD, comm_timeout_s=600) as cluster:
        trainer_procs.publish_cluster(tmp, cluster)
        trainer_procs.join(ctx, 150)
    runs = []
    for r in range(WORLD):
        with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
            runs.append(pickle.load(f))
    return runs


class TwoRankWithdrawalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.clean = _run_job("clean")

    def assert_clean(self, runs):
        for r in range(WORLD):
            self.assertTrue(runs[r]["channel"], f"rank {r}")
            for n, want in self.clean[r]["final"].items():
                self.assertTrue(torch.equal(runs[r]["final"][n], want), f"{n} on rank {r}")

    def test_one_ranks_withdrawal_is_sent_again_by_every_rank(self):
        runs = _run_job("move")
        self.assert_clean(runs)
        for r in range(WORLD):
            self.assertEqual(self.clean[r]["counts"], {"overlapped": STEPS - 1, "withdrawn": 0})
        # Rank 1 withdrew step 3; rank 0 had said go, and was answered
        # STEP_WITHDRAWN: both sent it again after their checks.
        for r in range(WORLD):
            self.assertEqual(runs[r]["counts"], {"overlapped": STEPS - 2, "withdrawn": 1},
                             f"rank {r}")

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
