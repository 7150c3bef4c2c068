"""muond.torch.Muon's memory through the real binaries (a coordinator and one
host daemon held to 1,024 open files, soft and hard): the params and grads
are packed into a few shm regions, so

* 100,000 params register and step with the trainer held to 1,024 open files
  as well, a sample of them equal to torch.optim.Muon's step (fp32 NS);
* the open files of trainer and daemon do not grow with the number of params;
* params without elements are a no-op as in torch.optim.Muon / AdamW (their
  state has torch's keys, without elements; an optimizer of only such params is
  refused by name), and
  the state dict round-trips (into muond and from torch.optim.Muon);
* a daemon started with a soft limit below its hard limit raises it.
"""
import os
import pickle
import re
import resource
import subprocess
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from common import (REL_TOL, ClusterTestCase, TorchReference, adamw_group,  # noqa: E402
                    muon_group, muond_opt)

OPEN_FILES = 1024
MANY = 100_000


def limit_open_files():
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def rel_diff(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# One trainer process held to OPEN_FILES: MANY 2x2 params, one step, then a
# sample of them beside torch.optim.Muon's step of the same values.
_TRAINER = r"""
import os, pickle, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[5]), int(sys.argv[5])))
import torch
from common import MUON, TorchReference
from muond.torch import Muon

daemon, job, n, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
gen = torch.Generator().manual_seed(0)
init, grads = torch.randn(n, 2, 2, generator=gen), torch.randn(n, 2, 2, generator=gen)
params = [torch.nn.Parameter(init[i].clone()) for i in range(n)]
opt = Muon([{"params": params}], daemons=[daemon], job_id=job, fp32_matmul_prec="highest",
           rpc_timeout=120, wait_healthy_timeout=120, **MUON)
for p, g in zip(params, grads):
    p.grad = g
opt.step()
sample = sorted(set(range(0, n, max(1, n // 40))) | {n - 1})
ref = [torch.nn.Parameter(init[i].clone()) for i in sample]
torch_opt = TorchReference([{"params": ref}])
for p, i in zip(ref, sample):
    p.grad = grads[i].clone()
torch_opt.step()
result = {"muond": [params[i].detach().clone() for i in sample],
          "torch": [p.detach().clone() for p in ref], "init": [init[i] for i in sample],
          "buffers": len(opt._buffers)}
opt.close()
with open(out, "wb") as f:
    pickle.dump(result, f)
print("stepped", flush=True)
"""


class MemoryRegionsTest(ClusterTestCase):
    NUM_DAEMONS = 1
    DAEMON_PREEXEC_FN = staticmethod(limit_open_files)

    def daemon_open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.cluster.process('muond-rank0').pid}/fd"))

    def test_a_hundred_thousand_params_step_within_1024_open_files(self):
        with open(f"/proc/{self.cluster.process('muond-rank0').pid}/limits") as f:
            self.assertRegex(f.read(), rf"Max open files\s+{OPEN_FILES}\s+{OPEN_FILES}")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.pkl")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            proc = subprocess.run(
                [sys.executable, "-c", _TRAINER, self.cluster.daemons[0], self.cluster.job_id,
                 str(MANY), out, str(OPEN_FILES)], env=env, capture_output=True, text=True,
                timeout=240, cwd=os.path.dirname(os.path.abspath(__file__)))
            self.assertIn("stepped", proc.stdout, proc.stderr[-3000:])
            with open(out, "rb") as f:
                result = pickle.load(f)
        # One param buffer and one grad buffer (fp32 on the CPU).
        self.assertEqual(result["buffers"], 2)
        for got, want, init in zip(result["muond"], result["torch"], result["init"]):
            self.assertFalse(torch.equal(got, init))
            self.assertLessEqual(rel_diff(got, want), REL_TOL)

    def test_the_servers_raise_their_soft_limit_to_the_hard_limit(self):
        def soft_below_hard():
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

        with Cluster(num_daemons=1, daemon_preexec_fn=soft_below_hard) as cluster:
            with open(f"/proc/{cluster.process('muond-rank0').pid}/limits") as f:
                soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", f.read()).groups()
            self.assertEqual(soft, hard)
            self.assertIn("open files (RLIMIT_NOFILE): soft limit", cluster.logs())
            self.assertIn("(was 256)", cluster.logs())

    def test_open_files_do_not_grow_with_the_params(self):
        grown = {}
        for n in (4, 4000):
            params = [torch.nn.Parameter(torch.randn(2, 2)) for _ in range(n)]
            mine, daemon = len(os.listdir("/proc/self/fd")), self.daemon_open_files()
            opt = muond_opt(self.cluster, [muon_group(params, [f"w{i}" for i in range(n)])])
            try:
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                grown[n] = (len(os.listdir("/proc/self/fd")) - mine,
                            self.daemon_open_files() - daemon)
            finally:
                opt.close()
        # gRPC may open a descriptor or two lazily; a region per param would
        # add thousands.
        for side in (0, 1):
            self.assertLessEqual(grown[4000][side], grown[4][side] + 2, grown)

    def test_params_without_elements_are_a_no_op_as_in_torch(self):
        def model():
            g = torch.Generator().manual_seed(5)
            return {"w": torch.nn.Parameter(torch.randn(6, 4, generator=g)),
                    "w0": torch.nn.Parameter(torch.zeros(0, 4)),
                    "b": torch.nn.Parameter(torch.randn(4, generator=g)),
                    "b0": torch.nn.Parameter(torch.zeros(0))}

        def groups(m):
            return [muon_group([m["w"], m["w0"]], ["w", "w0"]),
                    adamw_group([m["b"], m["b0"]], ["b", "b0"])]

        def step(m, opt, seed):
            g = torch.Generator().manual_seed(seed)
            for p in m.values():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

        ours, theirs = model(), model()
        ref = TorchReference(groups(theirs))
        opt = muond_opt(self.cluster, groups(ours))
        try:
            for seed in (1, 2):
                step(ours, opt, seed)
                step(theirs, ref, seed)
            saved = opt.state_dict()
        finally:
            opt.close()
        self.assertEqual(tuple(ours["w0"].shape), (0, 4))
        self.assertEqual(tuple(ours["b0"].shape), (0,))
        # Their state has torch.optim's keys and shapes (no elements).
        self.assertEqual(tuple(saved["state"][1]["momentum_buffer"].shape), (0, 4))
        self.assertEqual(tuple(saved["state"][3]["exp_avg"].shape), (0,))
        self.assertEqual(tuple(saved["state"][3]["exp_avg_sq"].shape), (0,))
        # A new optimizer resumes from the state dict: its third step is torch's.
        opt = muond_opt(self.cluster, groups(ours))
        try:
            opt.load_state_dict(saved)
            step(ours, opt, 3)
            step(theirs, ref, 3)
        finally:
            opt.close()
        for name in ("w", "b"):
            self.assertLessEqual(rel_diff(ours[name].detach(), theirs[name].detach()),
                                 REL_TOL, name)
        # Only params without elements: nothing to step, said before any daemon is asked.
        with self.assertRaisesRegex(ValueError, r"no param has elements \(w0 \(0, 4\)\)"):
            muond_opt(self.cluster, [muon_group([ours["w0"]], ["w0"])])
        # torch.optim.Muon's state dict, with its state of the empty param, loads.
        muon_sd = ref.muon.state_dict()
        self.assertEqual(tuple(muon_sd["state"][1]["momentum_buffer"].shape), (0, 4))
        opt = muond_opt(self.cluster, [muon_group([ours["w"], ours["w0"]], ["w", "w0"])])
        try:
            opt.load_state_dict(muon_sd)
            torch.testing.assert_close(opt.state_dict()["state"][0]["momentum_buffer"],
                                       muon_sd["state"][0]["momentum_buffer"])
        finally:
            opt.close()


if __name__ == "__main__":
    unittest.main()
