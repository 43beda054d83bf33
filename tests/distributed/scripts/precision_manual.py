"""Manual optimization under bf16 mixed precision (FiveDPrecision, ZeRO-0 masters), one rank.

Checks that ``self.clip_gradients`` before ``opt.step()`` acts on the gradients the fp32 masters
step with, and that two optimizers (toggle_optimizer) are refused with the fix named.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch

import lightning_5d
from lightning_5d.testing import leave_process_group
from tests_support import RecordingLM, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()


class ManualClip(RecordingLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.clip = True

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.clip:
            self.clip_gradients(opt, gradient_clip_val=1e-6, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoOptimizers(ManualClip):
    def configure_optimizers(self):
        params = list(self.parameters())
        return torch.optim.SGD(params[:2], lr=1.0), torch.optim.SGD(params[2:], lr=1.0)


def trainer():
    return L.Trainer(accelerator="cpu", devices=1, strategy=lightning_5d.FiveDStrategy(zero=0), precision="bf16-mixed",
                     max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)  # fmt: skip


L.seed_everything(0)
model = ManualClip()
before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
trainer().fit(model, datamodule=make_datamodule())
moved = max((p.detach().float() - before[n]).abs().max().item() for n, p in model.named_parameters())
# A second fit with the same Trainer: its new optimizer's masters must get the gradients.
plain = ManualClip()
plain.clip = False
second = trainer()
second.fit(plain, datamodule=make_datamodule())
after_first = {n: p.detach().float().clone() for n, p in plain.named_parameters()}
second.fit_loop.epoch_loop.max_steps = 4
second.fit(plain, datamodule=make_datamodule())
refit_moved = max((p.detach().float() - after_first[n]).abs().max().item() for n, p in plain.named_parameters())
error = None
try:
    trainer().fit(TwoOptimizers(), datamodule=make_datamodule())
except lightning_5d.PrecisionError as err:
    error = str(err)
Path(args.out, "result.json").write_text(json.dumps({"moved": moved, "refit_moved": refit_moved, "error": error}))
leave_process_group()
