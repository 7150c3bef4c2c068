"""Migrating between torch.optim and muond.torch.Muon through state dicts, in
both directions: muond's param groups carry torch.optim.Muon's / AdamW's keys
(ns_coefficients as the triple muond uses, adjust_lr_fn, amsgrad, foreach, ...),
so its state_dict loads into torch.optim.Muon / AdamW and their next steps
equal muond's next steps (NS fp32 on both sides, common.py's tolerance); and a
torch.optim state dict still loads into muond."""
import unittest

import torch

from common import (ADAMW, MUON, REL_TOL, ClusterTestCase, Tiny, adamw_group, batch,  # noqa: F401
                    fp32_newton_schulz, muon_group, muond_opt, rel_diff)


def step(model, opt, s, fp32_ns=False):
    x, y = batch(s)
    opt.zero_grad()
    model(x, y)["loss"].backward()
    if fp32_ns:
        with fp32_newton_schulz():
            opt.step()
    else:
        opt.step()


def clone(model):
    other = Tiny()
    other.load_state_dict(model.state_dict())
    return other


class TorchMigrationTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def run_pair(self, groups_of, torch_opt_of, names):
        """3 muond steps, then muond's state dict into torch.optim; 2 more
        steps on each side from the same params: equal (fp32 rounding)."""
        model = Tiny()
        opt = muond_opt(self.cluster, groups_of(model))
        try:
            for s in range(1, 4):
                step(model, opt, s)
            saved = opt.state_dict()
            twin = clone(model)
            other = torch_opt_of(twin)
            other.load_state_dict(saved)
            for s in range(4, 6):
                step(model, opt, s)
                step(twin, other, s, fp32_ns=True)
        finally:
            opt.close()
        for name in names:
            got, want = getattr(twin, name).detach(), getattr(model, name).detach()
            self.assertLess(rel_diff(got, want), REL_TOL, name)

    def test_muon_state_dict_loads_into_torch_optim_muon(self):
        self.run_pair(lambda m: [muon_group([m.fc1, m.fc2], ["fc1", "fc2"])],
                      lambda m: torch.optim.Muon([m.fc1, m.fc2], **MUON), ["fc1", "fc2"])

    def test_adamw_state_dict_loads_into_torch_optim_adamw(self):
        self.run_pair(lambda m: [adamw_group([m.fc1, m.fc2, m.bias], ["fc1", "fc2", "bias"])],
                      lambda m: torch.optim.AdamW([m.fc1, m.fc2, m.bias], **ADAMW),
                      ["fc1", "fc2", "bias"])

    def test_groups_carry_torch_keys_and_they_are_fixed(self):
        model = Tiny()
        opt = muond_opt(self.cluster, [muon_group([model.fc1, model.fc2], ["fc1", "fc2"]),
                                       adamw_group([model.bias], ["bias"])])
        try:
            torch_muon = torch.optim.Muon([model.fc1]).param_groups[0]
            torch_adamw = torch.optim.AdamW([model.bias]).param_groups[0]
            self.assertLessEqual(set(torch_muon), set(opt.param_groups[0]))
            self.assertLessEqual(set(torch_adamw), set(opt.param_groups[1]))
            self.assertEqual(opt.param_groups[0]["ns_coefficients"],
                             torch_muon["ns_coefficients"])
            opt.param_groups[0]["ns_coefficients"] = (3.0, -4.0, 2.0)
            x, y = batch(1)
            model(x, y)["loss"].backward()
            with self.assertRaisesRegex(ValueError, r"param group 0 \('dense'\): "
                                                    r"'ns_coefficients' changed"):
                opt.step()
        finally:
            opt.close()

    def test_torch_optim_muon_state_dict_loads_into_muond(self):
        model = Tiny()
        other = torch.optim.Muon([model.fc1, model.fc2], **MUON)
        for s in range(1, 4):
            step(model, other, s, fp32_ns=True)
        twin = clone(model)
        opt = muond_opt(self.cluster, [muon_group([twin.fc1, twin.fc2], ["fc1", "fc2"])])
        try:
            opt.load_state_dict(other.state_dict())
            for s in range(4, 6):
                step(model, other, s, fp32_ns=True)
                step(twin, opt, s)
        finally:
            opt.close()
        for name in ("fc1", "fc2"):
            self.assertLess(rel_diff(getattr(twin, name).detach(),
                                     getattr(model, name).detach()), REL_TOL, name)


if __name__ == "__main__":
    unittest.main()
