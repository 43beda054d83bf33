"""One training step of the reference model under FiveDStrategy(cp=WORLD_SIZE), measured.

Rank 0 writes, per rank: the bytes autograd saves inside the blocks' attention modules in
the first forward (parameters excluded), and the ring-attention work done (quarter-block
units, forward and backward). With --cp 1 it runs one process without the strategy's cp.
"""

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch.distributed as dist

import lightning_5d
from lightning_5d.testing import leave_process_group
from lightning_5d.accounting import SavedActivationMeter
from lightning_5d.models import TextDataModule
from tests_support import TINY, RecordingLM

parser = argparse.ArgumentParser()
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--sharding", default="zigzag", choices=["zigzag", "contiguous"])
parser.add_argument("--out", required=True)
args = parser.parse_args()


class AttentionMeter(L.Callback):
    """Meters saved tensors inside every block's attention during the first forward."""

    def __init__(self):
        self.bytes = 0
        self._active = None
        self._done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._done:
            return
        for layer in pl_module.model.layers:
            layer.attention.register_forward_pre_hook(self._enter)
            layer.attention.register_forward_hook(self._exit)

    def _enter(self, module, args):
        if not self._done:
            self._active = SavedActivationMeter().__enter__()

    def _exit(self, module, args, output):
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self.bytes += self._active.bytes
            self._active = None

    def on_before_backward(self, trainer, pl_module, loss):
        self._done = True


L.seed_everything(0)
world = int(os.environ["WORLD_SIZE"])
model = RecordingLM(config=replace(TINY, max_seq_len=args.seq))
meter = AttentionMeter()
trainer = L.Trainer(
    accelerator="cpu",
    strategy=lightning_5d.FiveDStrategy(cp=world, zero=1, context={"sharding": args.sharding}),
    devices=world,
    max_steps=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    callbacks=[meter],
)
trainer.fit(model, datamodule=TextDataModule(seq_len=args.seq, batch_size=1, num_samples=8, val_samples=2))
cp = trainer.strategy.context_parallel
record = {"attention_bytes": meter.bytes, "stats": dict(cp.stats) if cp is not None else {}}
records = [None] * dist.get_world_size()
dist.all_gather_object(records, record)
if dist.get_rank() == 0:
    Path(args.out).write_text(json.dumps({"cp": world, "per_rank": records}))

leave_process_group()  # objects above still hold process groups: leave together, then exit
