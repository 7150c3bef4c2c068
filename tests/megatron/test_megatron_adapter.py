"""muond.megatron against Megatron-Core's own Muon on a Megatron-Core GPT
(local transformer spec) trained on CPU under gloo: TP 2 x DP 2, 4 trainer
processes (adapter_ranks.py), one muond coordinator + 4 host daemons.

* The one-line change: ``muond.megatron.get_megatron_optimizer`` returns
  Megatron's ChainedOptimizer with muond's LayerShardedMuon in place of
  TensorParallelMuon, and trains to the same params as Megatron's own Muon
  (tp_mode "duplicated": full-matrix NS, fp32 NS on both sides) within fp32
  tolerances: the Muon matrices within MUON_TOL, every param within ANY_TOL
  (Adam's update of tiny biases amplifies a few-ulp difference of the
  forward).
* bf16 params (Megatron's Float16Module and mixed-precision wrapper, whose
  fp32 main params replace the model's in the Muon part after it is built)
  train like Megatron's own within BF16_TOL, and move.
* dist_checkpointing: a checkpoint of Megatron's own Muon resumes with
  muond's (its next step as Megatron's within the same tolerances); a checkpoint saved after STEPS steps and loaded into a
  new model and optimizer resumes bitwise; loaded at TP 1 x DP 4 it gives
  back the same params and trains on like the TP 2 x DP 2 job.
"""
from __future__ import annotations

import io
import multiprocessing
import os
import sys
import unittest

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "client", "python", "contract"))
from cluster import Cluster, find_binaries, free_tcp_port  # noqa: E402

try:
    import megatron_cpu  # noqa: E402,F401
    import megatron.core  # noqa: F401
    from megatron_trainer import rel_diff as rel
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

WORLD = 4
MUON_TOL = 1e-4
ANY_TOL = 1e-2
RESHARD_TOL = 1e-3
# bf16 params: a few bf16 ulps (2^-8 relative) of the largest element after
# a forward in bf16 on both sides.
BF16_TOL = 3e-2  # other TP/DP reduction orders, compounding over the steps
TIMEOUT_S = 300


def is_muon_matrix(name: str, t: torch.Tensor) -> bool:
    """Megatron's rule: 2-D and not an embedding or the output layer."""
    return t.ndim == 2 and "embedding" not in name and "output_layer" not in name


@unittest.skipUnless(HAVE_MEGATRON, "megatron-core is not installed (deploy/setup.sh installs it)")
class MegatronAdapterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        find_binaries(cls)
        cls.cluster = Cluster(WORLD, comm_timeout_s=30).start()
        try:
            cls.out = cls._run_ranks()
        except BaseException:
            cls.cluster.stop(print_logs=True, check_shm=False)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    @classmethod
    def _run_ranks(cls) -> dict:
        import adapter_ranks
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        port = free_tcp_port()
        procs = []
        checkpoint = os.path.join(cls.cluster.tmp, "checkpoint")
        megatron_checkpoint = os.path.join(cls.cluster.tmp, "megatron_checkpoint")
        os.makedirs(checkpoint)
        os.makedirs(megatron_checkpoint)
        for rank in range(WORLD):
            env = {"daemon": cls.cluster.daemons[rank], "job_id": cls.cluster.job_id,
                   "token": cls.cluster.token, "checkpoint": checkpoint,
                   "megatron_checkpoint": megatron_checkpoint}
            procs.append(ctx.Process(target=adapter_ranks.main,
                                     args=(rank, WORLD, port, env, results)))
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in range(WORLD):
                rank, out, error = results.get(timeout=TIMEOUT_S)
                if error is not None:
                    raise AssertionError(f"rank {rank} failed:\n{error}")
                got[rank] = torch.load(io.BytesIO(out))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        return got[0]

    def test_factory_returns_megatrons_chain_with_muonds_muon(self):
        self.assertEqual(self.out["kinds"], ["LayerShardedMuon", "AdamW"])

    def test_a_refusal_on_one_rank_reaches_every_rank(self):
        self.assertRegex(self.out["refusal"],
                         "^set_group_process_groups: rank 1: .*7 is not a param group index")

    def test_expert_bucket_is_a_second_muond_muon(self):
        got = self.out["expert_bucket"]
        self.assertEqual(got["names"], ["moe", "moe-1"])
        for name, ref in got["megatron"].items():
            tol = MUON_TOL if is_muon_matrix(name, ref) else ANY_TOL
            self.assertLessEqual(rel(got["muond"][name], ref), tol, name)

    def test_refusals_reach_every_rank_and_leave_the_optimizer_working(self):
        got = self.out["collective_refusals"]  # rank 0's view; rank 1 refused
        self.assertRegex(got["before_first_step"],
                         "^set_group_process_groups: rank 1: .*7 is not a param group index")
        self.assertRegex(got["different_groups"],
                         "every rank must remap the same param groups.*rank 1: \\[\\]")
        self.assertNotEqual(got["refused_by_placement"], "not refused")
        self.assertTrue(got["state_kept"])
        self.assertRegex(got["add_param_group"], "^add_param_group: rank 1: ")
        changed = "rank 1: param group 0 .*'ns_steps' changed from 5 to 6 after construction"
        self.assertRegex(got["changed_fixed_add"], "^add_param_group: " + changed)
        self.assertRegex(got["changed_fixed_replace"], "^set_group_process_groups: " + changed)
        self.assertEqual(got["steps_after"], 2)

    def test_expert_parallel_pairs_are_domains_of_their_own(self):
        """Ranks holding different params at the same (g, t) are no DP
        replicas: per-rank dense params and experts per expert-GTP pair."""
        got = self.out["expert_parallel"]
        self.assertLessEqual(got["dense"], MUON_TOL)
        self.assertLessEqual(got["expert"], MUON_TOL)
        self.assertGreater(got["moved"], 1e-3)

    def test_blockwise_tp_mode_warns_under_tp(self):
        self.assertTrue(self.out["blockwise_warned"])

    def test_trains_like_megatrons_own_muon(self):
        ref, got = self.out["megatron"], self.out["muond"]
        self.assertEqual(set(ref), set(got))
        muon = [n for n in ref if is_muon_matrix(n, ref[n])]
        self.assertGreaterEqual(len(muon), 8)  # qkv, proj, fc1, fc2 of 2 layers
        for name in ref:
            tol = MUON_TOL if name in muon else ANY_TOL
            self.assertLessEqual(rel(got[name], ref[name]), tol, name)
        for (loss_ref, norm_ref), (loss, norm) in zip(self.out["megatron_losses"],
                                                      self.out["muond_losses"]):
            self.assertAlmostEqual(loss, loss_ref, places=4)
            self.assertAlmostEqual(norm, norm_ref, places=4)
        # The steps moved every Muon matrix (a no-op optimizer on both
        # sides would pass the comparison above).
        for name in muon:
            self.assertGreater(rel(got[name], self.out["initial"][name]), 1e-3, name)

    def test_bf16_params_through_megatrons_mixed_precision_wrapper(self):
        self.assertEqual(self.out["bf16_kinds"], ["Float16OptimizerWithFloat16Params"] * 2)
        ref, got, init = (self.out["megatron_bf16"], self.out["muond_bf16"],
                          self.out["bf16_initial"])
        for name in ref:
            if is_muon_matrix(name, ref[name]):
                self.assertLessEqual(rel(got[name], ref[name]), BF16_TOL, name)
                self.assertGreater(rel(got[name], init[name]), 4 * BF16_TOL, name)

    def test_dist_checkpoint_resumes_bitwise(self):
        continued, resumed = self.out["continued"], self.out["resumed"]
        for name in continued:
            self.assertTrue(torch.equal(resumed[name], continued[name]), name)
        changed = [n for n in continued if not torch.equal(continued[n], self.out["muond"][n])]
        self.assertTrue(changed)  # the steps after the checkpoint changed params

    def test_megatrons_own_checkpoint_resumes_with_muond(self):
        """Saved by Megatron's own Muon after STEPS steps, loaded into a new
        model with muond's: the next step matches Megatron's next step."""
        ref, got = self.out["megatron_next"], self.out["migrated_next"]
        for name in ref:
            tol = MUON_TOL if is_muon_matrix(name, ref[name]) else ANY_TOL
            self.assertLessEqual(rel(got[name], ref[name]), tol, name)

    def test_dist_checkpoint_reshards_to_tp1_dp4(self):
        for name, saved in self.out["muond"].items():
            self.assertTrue(torch.equal(self.out["resharded_loaded"][name], saved), name)
        continued = self.out["continued"]
        for name, t in self.out["resharded"].items():
            tol = RESHARD_TOL if is_muon_matrix(name, t) else ANY_TOL
            self.assertLessEqual(rel(t, continued[name]), tol, name)


if __name__ == "__main__":
    unittest.main()
