"""An optimizer's lifetime leaves nothing behind, through the real binaries (a
coordinator and one host daemon): 10 cycles of create -> 2 steps -> drop, with
close() and without it, with the cyclic garbage collector off (CPython's
reference counting alone must end a dropped optimizer), keep at their baseline

* the process's shm objects of the job (/dev/shm names),
* the muond shm objects the process still maps (/proc/self/maps: the memory),
* the process's open file descriptors,
* the daemon's registration (GetStatus: no params once the optimizer is gone).

The first optimizer of a fresh process keeps neither itself nor its caller's
locals alive, and `del opt` alone unregisters and drops the fetched state.

The model lives across the cycles (each optimizer moves its params into fresh
buffers); the baseline is taken after one warm-up cycle, when the model's
params and grads live in the last optimizer's buffers and the gRPC runtime has
opened its own descriptors.
"""
import gc
import json
import os
import subprocess
import sys
import unittest
import weakref

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "contract"))
from cluster import ClusterTestCase  # noqa: E402  (coordinator + host daemons)
from muond.client import Client  # noqa: E402
from muond.shm import SHM_DIR, parse_shm_name  # noqa: E402
from muond.torch import Muon  # noqa: E402

CYCLES = 10
SHAPES = [(16, 8), (8, 4)]

# The first optimizer of a fresh process (torch.optim's first use imports
# torch._dynamo under it), the garbage collector off: once `train` returns,
# neither the optimizer nor its caller's locals may still be alive.
FIRST_OPTIMIZER = r"""
import gc, json, sys, weakref
import torch
from muond.torch import Muon
gc.disable()
def train(daemons, job_id):
    local = torch.ones(4)
    opt = Muon([torch.nn.Parameter(torch.ones(4, 4))], daemons=daemons, job_id=job_id,
               gtp_size=1, tp_size=1, rpc_timeout=30)
    return weakref.ref(local), weakref.ref(opt)
local, opt = train(sys.argv[1:-1], sys.argv[-1])
print(json.dumps({"caller's local": local() is not None, "optimizer": opt() is not None}))
"""


class OptimizerLifetimeTest(ClusterTestCase):
    def setUp(self):
        self.params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                       for i, s in enumerate(SHAPES)]
        self.daemon = Client(self.cluster.daemons[0], token=self.cluster.token)
        self.addCleanup(self.daemon.close)
        gc.disable()  # reference counting alone must end every optimizer
        self.addCleanup(gc.collect)  # after a failure: no optimizer left for the next test
        self.addCleanup(gc.enable)

    # -- what one cycle may leave behind ------------------------------------------
    def job_shm_names(self) -> list[str]:
        return sorted(n for n in os.listdir(SHM_DIR)
                      if parse_shm_name(n) == (self.cluster.job_id, os.getpid()))

    def mapped_shm_objects(self) -> set[str]:
        with open("/proc/self/maps") as f:
            return {line.split()[5] for line in f
                    if len(line.split()) > 5 and f"/muond-{self.cluster.job_id}-" in line}

    @staticmethod
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def registered_params(self) -> int:
        return self.daemon.status().num_params

    def footprint(self) -> dict:
        return {"shm names": self.job_shm_names(),
                "mapped shm objects": len(self.mapped_shm_objects()),
                "open fds": self.open_fds(), "registered params": self.registered_params()}

    # -- one cycle ------------------------------------------------------------------
    def cycle(self, close: bool, seed: int) -> None:
        opt = Muon(self.params, daemons=self.cluster.daemons, job_id=self.cluster.job_id,
                   gtp_size=1, tp_size=1, lr=0.02, rpc_timeout=30,
                   name="")  # the default instance, which self.daemon.status() reports
        gen = torch.Generator().manual_seed(seed)
        before = [p.detach().clone() for p in self.params]
        for _ in range(2):
            for p in self.params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        self.assertEqual(self.registered_params(), len(SHAPES))
        for p, b in zip(self.params, before):
            self.assertFalse(torch.equal(p.detach(), b))  # the daemon stepped them
        if close:
            opt.close()
        gone = weakref.ref(opt)
        del opt
        self.assertIsNone(gone(), "the dropped optimizer is still alive (a reference cycle?)")

    def check_cycles_keep_the_baseline(self, close: bool) -> None:
        self.cycle(close, seed=0)
        baseline = self.footprint()
        self.assertEqual(baseline["shm names"], [])
        self.assertEqual(baseline["registered params"], 0)
        for i in range(CYCLES):
            self.cycle(close, seed=i + 1)
            self.assertEqual(self.footprint(), baseline, f"after cycle {i + 1}")
        # The model works on in the memory the last optimizer left it.
        for p in self.params:
            p.detach().mul_(2)
            self.assertTrue(torch.isfinite(p).all())

    # -- the tests ------------------------------------------------------------------
    def test_cycles_with_close_keep_the_baseline(self):
        self.check_cycles_keep_the_baseline(close=True)

    def test_cycles_without_close_keep_the_baseline(self):
        self.check_cycles_keep_the_baseline(close=False)

    def test_first_optimizer_of_a_process_keeps_no_frame_alive(self):
        out = subprocess.run(
            [sys.executable, "-c", FIRST_OPTIMIZER, *self.cluster.daemons, self.cluster.job_id],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self.assertEqual(out.returncode, 0, out.stderr)
        alive = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(alive, {"caller's local": False, "optimizer": False})
        self.assertEqual(self.registered_params(), 0)

    def test_del_alone_unregisters(self):
        opt = Muon(self.params, daemons=self.cluster.daemons, job_id=self.cluster.job_id,
                   gtp_size=1, tp_size=1, lr=0.02, rpc_timeout=30,
                   name="")  # the default instance, which self.daemon.status() reports
        for p in self.params:
            p.grad = torch.ones_like(p)
        opt.step()
        # opt.state fetched and cached (its entries point back at the cache)
        momentum = weakref.ref(opt.state[self.params[0]]["momentum_buffer"])
        self.assertEqual(self.registered_params(), len(SHAPES))
        del opt
        self.assertEqual(self.registered_params(), 0)
        self.assertEqual(self.job_shm_names(), [])
        self.assertIsNone(momentum(), "the fetched state outlived its optimizer")


if __name__ == "__main__":
    unittest.main()
