"""0-D params (a scalar such as CLIP's logit_scale) on real host daemons,
given with the model's named_parameters(): they go to the AdamW group, step
as torch.optim.AdamW steps them (NS of the matrices in fp32 on both sides:
common.py's tolerances), and their state is torch's, 0-D ``exp_avg`` and
``exp_avg_sq``; state_dict / load_state_dict and
torch.distributed.checkpoint resume bitwise; split mode over two daemons and
local mode over one. A 0-D param in a Muon group is refused naming it."""
import os
import shutil
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (MUON, REL_TOL, ClusterTestCase, bitwise_mismatches,  # noqa: E402
                    fp32_newton_schulz, muond_opt, rel_diff)

from muond.torch import Muon  # noqa: E402

# What the plain split gives the AdamW group: the constructor's lr and
# weight_decay, muond's AdamW defaults (README "Differences from torch.optim").
ADAMW = dict(lr=MUON["lr"], weight_decay=MUON["weight_decay"], betas=(0.9, 0.95), eps=1e-8)


class Scaled(torch.nn.Module):
    """A weight matrix (Muon), a bias and a 0-D logit scale (AdamW)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.fc = torch.nn.Parameter(torch.randn(4, 8, generator=g) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(4, generator=g) * 0.1)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def loss(self, step):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        return torch.nn.functional.mse_loss((x @ self.fc.T + self.bias) * self.logit_scale, y)


def train(model, opt, steps):
    for s in steps:
        opt.zero_grad()
        model.loss(s).backward()
        with fp32_newton_schulz():
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class TorchSide:
    """torch.optim.Muon on the matrix, torch.optim.AdamW on the rest."""

    def __init__(self, model):
        self.muon = torch.optim.Muon([model.fc], **MUON)
        self.adamw = torch.optim.AdamW([model.bias, model.logit_scale], **ADAMW)

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()

    def step(self):
        self.muon.step()
        self.adamw.step()


def dcp_round_trip(model, opt, into_model, into_opt, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp)
    state = {"optim": get_optimizer_state_dict(into_model, into_opt)}  # DCP's template
    dcp.load(state, checkpoint_id=tmp)
    set_optimizer_state_dict(into_model, into_opt, state["optim"])


class ScalarParamsTest(ClusterTestCase):
    NUM_DAEMONS = 2
    MODE = {}  # split mode over the cluster's daemons (muond_opt)

    def optimizer(self, model, name=""):
        opt = muond_opt(self.cluster, model.named_parameters(), name=name, **self.MODE)
        self.addCleanup(opt.close)
        return opt

    def test_a_0d_param_steps_as_torch_adamw_with_0d_state(self):
        model, ref = Scaled(), Scaled()
        opt, torch_opt = self.optimizer(model), TorchSide(ref)
        self.assertEqual([g["algorithm"] for g in opt.param_groups], ["muon", "adamw"])
        got, want = train(model, opt, [1, 2, 3]), train(ref, torch_opt, [1, 2, 3])
        for name in want:
            self.assertLessEqual(rel_diff(got[name], want[name]), REL_TOL, name)
        self.assertNotEqual(float(got["logit_scale"]), 2.0)
        state = opt.state_dict()["state"][2]  # fc, bias, logit_scale
        torch_state = torch_opt.adamw.state[ref.logit_scale]
        self.assertEqual(sorted(state), ["exp_avg", "exp_avg_sq", "step"])
        for key in state:
            self.assertEqual(state[key].shape, torch_state[key].shape, key)
            self.assertEqual(state[key].shape, torch.Size([]), key)
            self.assertLessEqual(rel_diff(state[key], torch_state[key]), REL_TOL, key)
        self.assertEqual(opt.state[model.logit_scale]["exp_avg"].shape, torch.Size([]))

    def test_state_dict_and_dcp_resume_bitwise(self):
        model = Scaled()
        opt = self.optimizer(model)
        train(model, opt, [1, 2])
        saved = opt.state_dict()
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        tmp = tempfile.mkdtemp(prefix="muond-scalar-dcp-")
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        resumed = []
        for name, load in (("load_state_dict", lambda m, o: o.load_state_dict(saved)),
                           ("dcp", lambda m, o: dcp_round_trip(model, opt, m, o, tmp))):
            m = Scaled()
            m.load_state_dict(snapshot)
            o = self.optimizer(m, name="resumed")  # beside opt: an instance of its own
            load(m, o)
            self.assertEqual(o.step_id, 2, name)
            resumed.append((name, train(m, o, [3, 4])))
            o.close()
        want = train(model, opt, [3, 4])
        for name, got in resumed:
            self.assertEqual(bitwise_mismatches(got, want), [], name)

    def test_a_0d_param_in_a_muon_group_is_refused_naming_it(self):
        model = Scaled()
        with self.assertRaisesRegex(ValueError, r"param logit_scale: Muon params must be "
                                                r"matrices .* a param of shape \(\) has none"):
            Muon([{"params": [model.fc, model.logit_scale],
                   "param_names": ["fc", "logit_scale"]}],
                 daemons=self.cluster.daemons, job_id=self.cluster.job_id,
                 tp_size=len(self.cluster.daemons), name="refused", **self.MODE)


class ScalarParamsLocalModeTest(ScalarParamsTest):
    """The same through local mode (one trainer per daemon)."""
    NUM_DAEMONS = 1
    MODE = {"shard_mode": "local"}


if __name__ == "__main__":
    unittest.main()
