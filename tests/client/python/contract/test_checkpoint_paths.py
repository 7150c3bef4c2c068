"""The checkpoint contract: every standard way a user checkpoints an
optimizer resumes muond.torch.Muon BITWISE equal to the uninterrupted run
(real daemons: a coordinator + 2 host daemons, weights split over both, an
AdamW group on one), and, as a check of the harness itself, the same
scenario with torch.optim.Muon gives 0.0 too.

Paths: torch.save / torch.load (torch.load's default weights_only=True) of
opt.state_dict(); torch.distributed.checkpoint through
get_optimizer_state_dict / set_optimizer_state_dict; HF transformers Trainer
with optimizers=(opt, scheduler) and resume_from_checkpoint; a Lightning
Trainer checkpoint and fit(ckpt_path=...); and a state over gRPC's default
4 MiB message (one 1500 x 1000 weight on one daemon) through torch.save.

Each scenario: run A steps `total` steps; run B steps `at` steps, is
checkpointed the path's way and closed; run C starts from fresh objects,
restores B's checkpoint and steps on to `total`; C must equal A bitwise.
"""
import io
import os
import shutil
import sys
import tempfile
import unittest
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ClusterTestCase, Tiny, bitwise_mismatches, load_params,  # noqa: E402
                    muon_group, muond_opt, muond_tiny_opt, params_of, torch_tiny_opt, train,
                    dataset)

warnings.filterwarnings("ignore")


def close(opt):
    getattr(opt, "close", lambda: None)()


def resume_scenario(make_opt, save, load, tmp, total=4, at=2):
    """Mismatches (param: max |diff|) of the resumed run against the
    uninterrupted one."""
    model = Tiny()
    opt = make_opt(model)
    try:
        train(model, opt, total)
    finally:
        close(opt)
    want = params_of(model)

    model = Tiny()
    opt = make_opt(model)
    try:
        train(model, opt, at)
        blob = save(opt, model, tmp)
        weights = params_of(model)
    finally:
        close(opt)

    model = Tiny()
    load_params(model, weights)
    opt = make_opt(model)
    try:
        load(opt, model, blob, tmp)
        train(model, opt, total - at, first=at + 1)
    finally:
        close(opt)
    return bitwise_mismatches(params_of(model), want)


# -- the paths -----------------------------------------------------------------
def torch_save(opt, model, tmp):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue()


def torch_load(opt, model, blob, tmp):
    opt.load_state_dict(torch.load(io.BytesIO(blob)))  # weights_only=True: torch's default


def dcp_save(opt, model, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    path = os.path.join(tmp, "dcp")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return path


def dcp_load(opt, model, path, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    state = {"optim": get_optimizer_state_dict(model, opt)}  # the template DCP fills
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])


class CheckpointPathsTest(ClusterTestCase):
    NUM_DAEMONS = 2

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="muond-contract-ckpt-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def muond(self, model):
        return muond_tiny_opt(self.cluster, model)

    def check_path(self, save, load):
        for name, make in (("torch.optim.Muon", torch_tiny_opt), ("muond", self.muond)):
            with self.subTest(optimizer=name):
                tmp = tempfile.mkdtemp(dir=self.tmp)
                self.assertEqual(resume_scenario(make, save, load, tmp), [],
                                 f"{name}: resumed run differs from the uninterrupted one")

    def test_torch_save_state_dict(self):
        self.check_path(torch_save, torch_load)

    def test_torch_distributed_checkpoint(self):
        self.check_path(dcp_save, dcp_load)

    # -- HF transformers Trainer -------------------------------------------------
    def hf_train(self, make_opt, out, resume=None):
        from transformers import Trainer, TrainingArguments
        model = Tiny()
        opt = make_opt(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
        args = TrainingArguments(
            output_dir=out, max_steps=4, save_strategy="steps", save_steps=2,
            per_device_train_batch_size=4, use_cpu=True, report_to=[], logging_strategy="no",
            seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(),
                          optimizers=(opt, sched))
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            close(opt)
        return params_of(model)

    def test_hf_trainer_resume_from_checkpoint(self):
        for name, make in (("torch.optim.Muon", torch_tiny_opt), ("muond", self.muond)):
            with self.subTest(optimizer=name):
                first, second = (tempfile.mkdtemp(dir=self.tmp) for _ in range(2))
                want = self.hf_train(make, first)
                got = self.hf_train(make, second,
                                    resume=os.path.join(first, "checkpoint-2"))
                self.assertEqual(bitwise_mismatches(got, want), [],
                                 f"{name}: HF resume differs from the uninterrupted run")

    # -- Lightning -------------------------------------------------------------
    def lightning_fit(self, make_opt, out, ckpt_path=None):
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint

        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = Tiny()
                self.opt = None

            def training_step(self, batch, batch_idx):
                return self.net(batch["x"], batch["y"])["loss"]

            def configure_optimizers(self):
                self.opt = make_opt(self.net)
                return self.opt

        lit = Lit()
        loader = torch.utils.data.DataLoader(dataset(8), batch_size=4, shuffle=False)
        trainer = L.Trainer(
            max_epochs=2, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
            callbacks=[ModelCheckpoint(dirpath=out, filename="{epoch}", every_n_epochs=1,
                                       save_top_k=-1)])
        try:
            trainer.fit(lit, loader, ckpt_path=ckpt_path)
        finally:
            close(lit.opt)
        return {f"net.{k}": v for k, v in params_of(lit.net).items()}

    def test_lightning_fit_ckpt_path(self):
        for name, make in (("torch.optim.Muon", torch_tiny_opt), ("muond", self.muond)):
            with self.subTest(optimizer=name):
                first, second = (tempfile.mkdtemp(dir=self.tmp) for _ in range(2))
                want = self.lightning_fit(make, first)
                got = self.lightning_fit(make, second,
                                         ckpt_path=os.path.join(first, "epoch=0.ckpt"))
                self.assertEqual(bitwise_mismatches(got, want), [],
                                 f"{name}: Lightning resume differs from the uninterrupted run")


class LargeStateTest(ClusterTestCase):
    """A momentum of 1500 x 1000 fp32 (6 MB) on one daemon: over gRPC's
    default 4 MiB message, so it must stream."""
    NUM_DAEMONS = 1
    SHAPE = (1500, 1000)

    def grad(self, step):
        return torch.randn(*self.SHAPE, generator=torch.Generator().manual_seed(step))

    def run_steps(self, w, opt, steps, first=1):
        for s in range(first, first + steps):
            opt.zero_grad()
            w.grad = self.grad(s)
            opt.step()

    def test_state_over_4_mib_resumes_bitwise_through_torch_save(self):
        initial = torch.randn(*self.SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02

        def make(w):
            return muond_opt(self.cluster, [muon_group([w], ["big"])])

        w = torch.nn.Parameter(initial.clone())
        with make(w) as opt:
            self.run_steps(w, opt, 2)
        want = w.detach().clone()

        w = torch.nn.Parameter(initial.clone())
        with make(w) as opt:
            self.run_steps(w, opt, 1)
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
        saved = torch.load(io.BytesIO(buf.getvalue()))
        momentum = saved["state"][0]["momentum_buffer"]
        self.assertEqual(tuple(momentum.shape), self.SHAPE)
        self.assertGreater(momentum.numel() * 4, 4 * 1024 * 1024)

        w = torch.nn.Parameter(w.detach().clone())
        with make(w) as opt:
            opt.load_state_dict(saved)
            self.run_steps(w, opt, 1, first=2)
        self.assertEqual(bitwise_mismatches({"big": w.detach()}, {"big": want}), [])


if __name__ == "__main__":
    unittest.main()
