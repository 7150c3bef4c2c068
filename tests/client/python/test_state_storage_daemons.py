"""Optimizer-state dtype and location through the real binaries (a
coordinator and one host daemon):

* GetStatus's state_bytes_by and `muonctl status` report each group's state
  in the dtype and location it asked for, "auto" following torch's rule
  (bf16 for all-bf16 params, else fp32); the expected bytes are computed
  here from the shapes (elements x dtype size, AdamW two moments; fp8 e4m3
  one byte per element plus an fp32 scale per started block of 256). On a
  host daemon "host" is the same host memory as "device": accepted.
* "auto" is resolved over the whole group, not by each daemon over the
  params it holds: an AdamW group of a bf16 and an fp32 param split over two
  daemons keeps fp32 state for both, and steps bitwise as on one daemon.
* bf16 momentum goes through state_dict() -> torch.save -> torch.load ->
  load_state_dict() of a new optimizer and continues bitwise equal to the
  uninterrupted run; its entries are fp32 copies holding bf16 values exactly,
  and an optimizer with fp32 state loads them as they are.
"""
import io
import os
import subprocess
import sys
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
from cluster import Cluster, ClusterTestCase, _find_binary  # noqa: E402
from muond.torch import Muon  # noqa: E402

SIZES = {"fp32": 4, "bf16": 2}
# GetStatus's order: location (device first), then dtype (core/common/dtype.h).
LOCATIONS = ("device", "host")
DTYPES = ("fp32", "bf16", "fp8_e4m3")


def values(seed, shape, dtype=torch.float32):
    v = np.random.default_rng(seed).uniform(-1, 1, size=shape).astype(np.float32)
    return torch.from_numpy(v).to(dtype)


def tensor_bytes(dtype: str, n: int) -> int:
    if dtype == "fp8_e4m3":
        return n + 4 * ((n + 255) // 256)
    return n * SIZES[dtype]


class StateStorageDaemonTest(ClusterTestCase):
    NUM_DAEMONS = 1

    def build(self, groups, **kw):
        opt = Muon(groups, daemons=self.cluster.daemons, job_id=self.cluster.job_id,
                   rpc_timeout=30, lr=0.02, **kw)
        self.addCleanup(opt.close)
        return opt

    @staticmethod
    def train(opt, params, steps):
        for step in steps:
            for i, p in enumerate(params):
                p.grad = values(1000 * step + i, tuple(p.shape), p.dtype)
            opt.step()
        return [p.detach().clone() for p in params]

    def status_by(self, opt):
        """GetStatus of `opt`'s optimizer instance (a process's later
        optimizers are instances of their own)."""
        with self.cluster.client(self.cluster.daemons[0], optimizer=opt.name) as client:
            status = client.status()
        return status, [(b.location, b.dtype, b.bytes) for b in status.state_bytes_by]

    def muonctl_status(self, opt):
        token = ([f"--token_file={os.path.join(self.cluster.tmp, 'token')}"]
                 if self.cluster.token else [])
        instance = ["--optimizer", opt.name] if opt.name else []
        return subprocess.run(
            [_find_binary("tools/muonctl/muonctl"), "status", "--coordinator",
             self.cluster.coordinator, "--job_id", self.cluster.job_id, *token, *instance],
            capture_output=True, text=True, timeout=60)

    def expect_state_bytes(self, spec):
        """Registers `spec` (name -> (algorithm, param shapes, param dtype,
        {state keys}, (expected location, expected dtype))), steps once and
        compares GetStatus and muonctl with the bytes the shapes give."""
        groups, params, want = [], [], {}
        for i, (name, (algorithm, shapes, dtype, keys, (location, state))) in enumerate(
                spec.items()):
            ps = [torch.nn.Parameter(values(10 * i + j, s, dtype)) for j, s in enumerate(shapes)]
            params += ps
            groups.append({"params": ps, "name": name, "algorithm": algorithm, **keys})
            moments = 2 if algorithm == "adamw" else 1
            for s in shapes:
                n = int(np.prod(s))
                want[(location, state)] = (want.get((location, state), 0)
                                           + moments * tensor_bytes(state, n))
        opt = self.build(groups)
        self.train(opt, params, [1])
        expected = [(loc, dt, want[(loc, dt)]) for loc in LOCATIONS for dt in DTYPES
                    if (loc, dt) in want]
        status, got = self.status_by(opt)
        self.assertEqual(got, expected)
        self.assertEqual(status.state_bytes, sum(want.values()))
        out = self.muonctl_status(opt)
        self.assertEqual(out.returncode, 0, out.stderr)
        line = ", ".join(f"{loc} {dt} {n}" for loc, dt, n in expected)
        self.assertIn(f"rank 0 state: {line} (total {sum(want.values())} bytes)\n",
                      out.stdout)
        opt.close()

    def test_status_and_muonctl_report_state_bytes_by_location_and_dtype(self):
        bf16 = torch.bfloat16
        self.expect_state_bytes({
            "f32": ("muon", [(8, 6), (6, 5)], torch.float32, {}, ("device", "fp32")),
            "b16": ("muon", [(8, 6)], bf16, {}, ("device", "bf16")),
            "host_b16": ("muon", [(7, 5)], torch.float32,
                         {"state_dtype": "bf16", "state_location": "host"}, ("host", "bf16")),
            "b16_as_f32": ("muon", [(4, 6)], bf16, {"state_dtype": "fp32"},
                           ("device", "fp32")),
            "adam": ("adamw", [(10,)], torch.float32, {"state_location": "host"},
                     ("host", "fp32")),
        })

    # AdamW moments of bf16 params (auto) and fp8 state of either algorithm.
    def test_adamw_bf16_and_fp8_state_bytes(self):
        self.expect_state_bytes({
            "adam_b16": ("adamw", [(10,)], torch.bfloat16, {}, ("device", "bf16")),
            "muon_fp8": ("muon", [(24, 20)], torch.float32, {"state_dtype": "fp8_e4m3"},
                         ("device", "fp8_e4m3")),
            "adam_fp8": ("adamw", [(300,)], torch.float32,
                         {"state_dtype": "fp8_e4m3", "state_location": "host"},
                         ("host", "fp8_e4m3")),
        })

    def test_bf16_state_resumes_bitwise_through_a_state_dict(self):
        def fresh(snapshot=None):
            return [torch.nn.Parameter(snapshot[i].clone() if snapshot else
                                       values(50 + i, s))
                    for i, s in enumerate([(8, 6), (5,)])]

        def optimizer(params, state_dtype):
            return self.build([{"params": params[:1], "name": "w", "state_dtype": state_dtype},
                               {"params": params[1:], "name": "b", "algorithm": "adamw"}])

        params = fresh()
        opt = optimizer(params, "bf16")
        self.train(opt, params, [1, 2])
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        snapshot = [p.detach().clone() for p in params]
        want = self.train(opt, params, [3, 4])
        opt.close()

        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        momentum = saved["state"][0]["momentum_buffer"]
        self.assertEqual(momentum.dtype, torch.float32)
        self.assertTrue(torch.equal(momentum, momentum.to(torch.bfloat16).float()))
        self.assertGreater(int(momentum.ne(0).sum()), 0)

        resumed = fresh(snapshot)
        opt = optimizer(resumed, "bf16")
        opt.load_state_dict(saved)
        got = self.train(opt, resumed, [3, 4])
        opt.close()
        for name, g, w in zip(("w", "b"), got, want):
            np.testing.assert_array_equal(g.numpy(), w.numpy(), err_msg=name)

        # Into fp32 state: the bf16 values as they are.
        opt = optimizer(fresh(snapshot), "fp32")
        opt.load_state_dict(saved)
        self.assertTrue(torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum))
        opt.close()


class AutoStateDtypeDaemonTest(ClusterTestCase):
    """Two daemons, each holding one param of every AdamW group (split mode
    places the second param on the less loaded daemon)."""
    NUM_DAEMONS = 2

    @staticmethod
    def groups():
        dtypes = {"mixed": (torch.bfloat16, torch.float32), "b16": (torch.bfloat16,) * 2}
        params = {name: [torch.nn.Parameter(values(7 * i + j, (n,), d))
                         for j, d in enumerate(ds)]
                  for i, (name, ds, n) in enumerate(
                      [("mixed", dtypes["mixed"], 1000), ("b16", dtypes["b16"], 300)])}
        return params, [{"params": ps, "name": name, "algorithm": "adamw"}
                        for name, ps in params.items()]

    def run_on(self, cluster):
        params, groups = self.groups()
        opt = Muon(groups, daemons=cluster.daemons, job_id=cluster.job_id,
                   tp_size=len(cluster.daemons), rpc_timeout=30, lr=0.02)
        try:
            flat = [p for ps in params.values() for p in ps]
            after = StateStorageDaemonTest.train(opt, flat, [1, 2, 3])
            status = [[(b.location, b.dtype, b.bytes) for b in s.state_bytes_by]
                      for s in opt.status()]
        finally:
            opt.close()
        return after, status

    def test_auto_is_the_groups_dtype_on_every_daemon(self):
        after, status = self.run_on(self.cluster)
        # torch's rule over each group: "mixed" fp32, "b16" bf16; each daemon
        # holds one param of each, two moments per element.
        per_daemon = [("device", "fp32", 2 * tensor_bytes("fp32", 1000)),
                      ("device", "bf16", 2 * tensor_bytes("bf16", 300))]
        self.assertEqual(status, [per_daemon, per_daemon])
        with Cluster(num_daemons=1) as one:
            want, _ = self.run_on(one)
        for i, (g, w) in enumerate(zip(after, want)):
            self.assertTrue(torch.equal(g, w), f"param {i}: differs from one daemon's run")


if __name__ == "__main__":
    unittest.main()
