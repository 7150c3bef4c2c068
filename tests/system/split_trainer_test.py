"""Split mode system test, Python single-trainer mode: muond-coordinator + 4 muond
daemons (2x2 GTP_remat x TP domain, host mode, Gloo), launched as the real
binaries, and one trainer in this process whose weights `muond.torch.Muon`
splits across the daemons (client/python/muond/split.py): column-parallel,
row-parallel, padded (a row-parallel weight with an odd number of rows),
untagged, and weights that do not split (solo: whole on one daemon, a 1x1
domain), plus an AdamW group (solo too).

Three steps must equal the single-process reference BITWISE. The reference
runs the same math on the same backend: the C++ CPU backend through
tests/core/muon:muon_cli (MuonStepFullMatrix / AdamWStep on each full matrix),
not torch (whose GEMMs round differently). docs/ARCHITECTURE.md "One step"'s numerics contract
(ns_batch_size = 1) makes this exact.

Plans: step 1 runs plan v1 (ns_cost). Then a Rebalance RPC with a cost table
that inverts the analytic order pushes v2, activating at step 2, with other
homes; then a Rebalance with the "measured" cost model (built from the shape
timings the daemons reported) pushes v3 activating at step 3. Each step must
run with the plan version it expects, and the results stay bitwise equal.
"""
import os
import subprocess
import sys
import shutil
import tempfile
import unittest
import uuid

import grpc
import numpy as np
import torch

from muond.torch import Muon
from muond.v1 import muond_pb2 as pb
from muond.v1 import muond_pb2_grpc as pb_grpc

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The coordinator + host daemons (also the contract suite's fixture).
sys.path.insert(0, os.path.join(RUNFILES, "tests", "client", "python", "contract"))
from cluster import Cluster, wait_for  # noqa: E402

MUON_CLI = os.path.join(RUNFILES, "tests/core/muon/muon_cli")
G, T = 2, 2
STEPS = 3

# Muon hyperparameters of the trainer and, identically, of the reference.
LR, WD, MOMENTUM = 0.02, 0.01, 0.95
NS_TYPE, NS_STEPS, NS_EPS = "quintic", 5, 1e-7
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)

# name: (shape, Megatron tags {tensor_model_parallel, partition_dim} or None)
MUON_WEIGHTS = {
    "col": ((16, 12), (True, 0)),       # column-parallel: rows over T, then G
    "row": ((12, 16), (True, 1)),       # row-parallel: columns over T
    "pad": ((9, 8), (True, 1)),         # row-parallel, 9 rows: 1 GTP pad row
    "untagged": ((20, 6), None),        # no tags: split along dim 0
    "solo_a": ((7, 5), None),           # splits along neither dim: solo
    "solo_b": ((5, 3), None),           # another solo (least-loaded daemon)
}
ADAMW_PARAMS = {"bias": (16,), "norm": (7,), "embed": (10, 4)}
DENSE_SHAPES = [MUON_WEIGHTS[n][0] for n in ("col", "row", "pad", "untagged")]


def values(seed, shape):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


class SplitTrainerSystemTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="muond-split-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        # Unique across parallel runs: sandboxes have their own pid namespace
        # but share /dev/shm, where the client's shm names include the job.
        self.job = f"split{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.cluster = Cluster(G * T, token=False, job_id=self.job, comm_timeout_s=30).start()
        self.coordinator, self.daemons = self.cluster.coordinator, self.cluster.daemons
        self.channel = grpc.insecure_channel(self.coordinator)
        self.coord = pb_grpc.CoordinatorStub(self.channel)

    def tearDown(self):
        self.channel.close()
        self.cluster.stop(print_logs=self._outcome_failed())

    def _outcome_failed(self):
        result = getattr(self._outcome, "result", None)
        errors = getattr(result, "errors", []) + getattr(result, "failures", [])
        return any(test is self for test, _ in errors)

    # -- the reference -------------------------------------------------------
    def cli(self, *args):
        proc = subprocess.run([MUON_CLI, *args], capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, f"muon_cli {args}: {proc.stderr}")

    def reference(self, name, kind, initial, grads):
        """`initial` (fp32 numpy) after len(grads) steps of muon_cli."""
        shape = initial.shape
        rows, cols = (shape if len(shape) == 2 else (1, shape[0]))
        param, grad_file, out = (os.path.join(self.tmp, f"{name}.{x}.bin")
                                 for x in ("param", "grads", "out"))
        initial.tofile(param)
        np.concatenate([g.reshape(-1) for g in grads]).astype(np.float32).tofile(grad_file)
        common = [f"rows={rows}", f"cols={cols}", f"iters={len(grads)}",
                  f"param={param}", f"grads={grad_file}", f"out={out}"]
        if kind == "muon":
            self.cli("muon", *common, f"lr={LR!r}", f"momentum={MOMENTUM!r}", f"wd={WD!r}",
                     "nesterov=1", f"type={NS_TYPE}", f"steps={NS_STEPS}", f"eps={NS_EPS!r}",
                     "scale=shape_scaling", "extra=1", "wd_method=decoupled")
        else:
            b1, b2 = ADAMW["betas"]
            self.cli("adamw", *common, f"lr={ADAMW['lr']!r}", f"beta1={b1!r}",
                     f"beta2={b2!r}", f"eps={ADAMW['eps']!r}", f"wd={ADAMW['weight_decay']!r}")
        return np.fromfile(out, dtype=np.float32).reshape(shape)

    # -- coordinator helpers ---------------------------------------------------
    def plan(self):
        return self.coord.GetPlan(pb.GetPlanRequest(job_id=self.job), timeout=10)

    def wait_reported(self, step):
        """Until every daemon's ReportTimings of `step` reached the coordinator."""
        def done():
            resp = self.coord.ListDaemons(pb.ListDaemonsRequest(job_id=self.job), timeout=10)
            return (len(resp.daemons) == G * T and
                    all(d.last_step_id >= step for d in resp.daemons))
        wait_for(done, 20, f"every daemon to report step {step}")

    def wait_daemons_have(self, opt, version):
        wait_for(lambda: all(s.latest_plan_version >= version for s in opt.status()), 20,
                 f"plan v{version} on every daemon")

    @staticmethod
    def dense_homes(plan):
        for g in plan.groups:
            if g.group == "dense":
                return [(h.g, h.t) for h in g.homes]
        raise AssertionError(f"no 'dense' group in plan v{plan.version}")

    # -- the test ----------------------------------------------------------------
    def test_split_trainer_bitwise_across_rebalances(self):
        muon_params, adamw_params, initial = [], [], {}
        for i, (name, (shape, tags)) in enumerate(MUON_WEIGHTS.items()):
            p = torch.nn.Parameter(torch.from_numpy(values(100 + i, shape)))
            if tags is not None:
                p.tensor_model_parallel, p.partition_dim = tags
            muon_params.append(p)
            initial[name] = p.detach().numpy().copy()
        for i, (name, shape) in enumerate(ADAMW_PARAMS.items()):
            p = torch.nn.Parameter(torch.from_numpy(values(200 + i, shape)))
            adamw_params.append(p)
            initial[name] = p.detach().numpy().copy()
        params = dict(zip(MUON_WEIGHTS, muon_params)) | dict(zip(ADAMW_PARAMS, adamw_params))

        opt = Muon([{"params": muon_params, "name": "dense",
                     "param_names": list(MUON_WEIGHTS)},
                    {"params": adamw_params, "name": "adam", "algorithm": "adamw",
                     "param_names": list(ADAMW_PARAMS), **ADAMW}],
                   lr=LR, weight_decay=WD, momentum=MOMENTUM, nesterov=True,
                   fp32_matmul_prec="highest",  # the fp32 reference's NS (not the default)
                   eps=NS_EPS, ns_steps=NS_STEPS, coefficient_type=NS_TYPE,
                   daemons=self.daemons, job_id=self.job, gtp_size=G, tp_size=T,
                   rpc_timeout=30)
        try:
            self.check_placement(opt)
            self.run_steps(opt, params, initial)
        finally:
            opt.close()

    def check_placement(self, opt):
        from muond.split import SplitLayout
        for name in ("col", "row", "pad", "untagged"):
            self.assertIsInstance(opt.layouts[name], SplitLayout, name)
        self.assertEqual(opt.layouts["col"].tp_dim, 0)
        self.assertEqual(opt.layouts["row"].tp_dim, 1)
        self.assertEqual(opt.layouts["pad"].pad_length, 1)
        for name in ("solo_a", "solo_b", *ADAMW_PARAMS):
            self.assertEqual(opt.layouts[name][0], "solo", name)

    def run_steps(self, opt, params, initial):
        grads = {name: [] for name in params}
        homes, versions = [], []
        for step in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=False)  # keeps the shared grads: .grad.copy_ below
            for i, (name, p) in enumerate(params.items()):
                g = values(1000 * step + i, tuple(p.shape))
                grads[name].append(g)
                p.grad.copy_(torch.from_numpy(g))
            opt.step()
            versions.append({r.plan_version for r in opt.last_responses})
            self.wait_reported(step)
            if step == 1:
                homes.append(self.dense_homes(self.plan()))
                # Costs that invert the analytic order (small matrices
                # expensive): other homes, from step 2 on.
                req = pb.RebalanceRequest(job_id=self.job, activate_after_steps=1)
                for rows, cols in DENSE_SHAPES:
                    req.cost_table.add(shape=[rows, cols], ns_us=1e6 / (rows * cols))
                v2 = self.coord.Rebalance(req, timeout=10)
                self.assertEqual((v2.version, v2.activate_at_step), (2, 2))
                homes.append(self.dense_homes(v2))
                self.assertNotEqual(homes[0], homes[1], "the cost table changed no home")
                self.wait_daemons_have(opt, 2)
            elif step == 2:
                # The daemons' measured per-shape NS times (ReportTimings).
                v3 = self.coord.Rebalance(pb.RebalanceRequest(
                    job_id=self.job, cost_model=pb.COST_MODEL_MEASURED, activate_after_steps=1),
                    timeout=10)
                self.assertEqual((v3.version, v3.activate_at_step, v3.cost_model),
                                 (3, 3, pb.COST_MODEL_MEASURED))
                self.wait_daemons_have(opt, 3)
        self.assertEqual(versions, [{1}, {2}, {3}])

        mismatches = []
        for name, p in params.items():
            kind = "muon" if name in MUON_WEIGHTS else "adamw"
            want = self.reference(name, kind, initial[name], grads[name])
            got = p.detach().numpy()
            self.assertEqual(got.shape, want.shape, name)
            if got.tobytes() != want.tobytes():
                diff = np.abs(got.astype(np.float64) - want).max()
                mismatches.append(f"{name}: max |diff| {diff:.3g}")
            # The update happened (not a no-op compared against itself).
            self.assertFalse(np.array_equal(got, initial[name]), f"{name} did not change")
        self.assertEqual(mismatches, [], "not bitwise equal to the reference")

        # GTP pad rows live after the model's tensor in the same buffer and
        # must still be zero.
        pad = opt.layouts["pad"]
        # The buffer is a view into one packed buffer per dtype: it starts at
        # the tensor's storage offset.
        data = params["pad"].data
        flat = torch.empty(0, dtype=torch.float32).set_(data.untyped_storage())
        start = data.storage_offset()
        rows, cols = pad.full_shape
        tail = flat[start + rows * cols:start + pad.buffer_numel].numpy()
        self.assertEqual(tail.size, pad.pad_length * cols)
        self.assertTrue(np.all(tail == 0), tail)


if __name__ == "__main__":
    unittest.main()
