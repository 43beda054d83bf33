"""Trainer.fit under FiveDStrategy(tp=2) with a model the strategy cannot map (--case unmappable)
or with an explicit plan that contradicts the model (--case conflict). Both must fail in
setup, before the first training step (which would print TRAINING STEP RAN)."""

import argparse
import os

import lightning as L
import torch
from torch import nn

import lightning_5d
from tests_support import TINY, RecordingLM, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["unmappable", "conflict"], required=True)
args = parser.parse_args()


class Unmappable(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 256))

    def training_step(self, batch, batch_idx):
        print("TRAINING STEP RAN")
        logits = self.net(batch["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class Noisy(RecordingLM):
    def training_step(self, batch, batch_idx):
        print("TRAINING STEP RAN")
        return super().training_step(batch, batch_idx)


if args.case == "unmappable":
    module, plan = Unmappable(), None
else:  # two patterns give q_proj two roles
    plan = {"model.layers.*.attention.q_proj": "attention.q", "model.layers.*.attention.*": "attention.o"}
    module = Noisy(config=TINY)
trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ["WORLD_SIZE"]),
    strategy=lightning_5d.FiveDStrategy(tp=2, model_plan=plan),
    max_steps=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, datamodule=make_datamodule())
