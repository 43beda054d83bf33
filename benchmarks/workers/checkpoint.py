"""One training run that saves every few steps: how long the step loop waits for each save,
and how many bytes each rank writes. Started by benchmarks/checkpoint_save.py under
torch.distributed.run; rank 0 writes the JSON result."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_5d
from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
from lightning_5d.testing import leave_process_group

parser = argparse.ArgumentParser()
parser.add_argument("--format", choices=["sharded", "full"], required=True)
parser.add_argument("--write", choices=["sync", "async"], default="sync")
parser.add_argument("--zero", type=int, default=3)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--model", default="{}", help="LlamaConfig fields as JSON")
parser.add_argument("--dir", required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()


class TimedStrategy(lightning_5d.FiveDStrategy):
    """Seconds the training loop spent inside save_checkpoint (what a save costs the run)."""

    blocked: list[float] = []

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.blocked.append(time.perf_counter() - t0)


L.seed_everything(0, verbose=False)
world = int(os.environ["WORLD_SIZE"])
model = LlamaLM(LlamaConfig(**json.loads(args.model)))
data = TextDataModule(seq_len=64, batch_size=2, val_samples=1, num_samples=2 * world * args.steps)
strategy = TimedStrategy(zero=args.zero, checkpoint_format=args.format, checkpoint_write=args.write)
saver = ModelCheckpoint(dirpath=args.dir, filename="{step}", save_top_k=-1, every_n_train_steps=args.save_every)
trainer = L.Trainer(
    accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=args.steps, logger=False,
    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[saver],
)  # fmt: skip
t0 = time.perf_counter()
trainer.fit(model, datamodule=data)
fit_s = time.perf_counter() - t0  # includes waiting for the last asynchronous save (teardown)

# Bytes each rank wrote: its own DCP file (sharded), or the whole file for rank 0 (full).
checkpoint = Path(args.dir) / f"step={args.steps}.ckpt"
if checkpoint.is_dir():
    per_rank = [(checkpoint / f"__{r}_0.distcp").stat().st_size for r in range(world)]
else:
    per_rank = [checkpoint.stat().st_size] + [0] * (world - 1)
blocked = [None] * world
dist.all_gather_object(blocked, TimedStrategy.blocked)
if dist.get_rank() == 0:
    result = {"fit_s": fit_s, "blocked_s": blocked, "bytes_per_rank": per_rank, "saves": len(TimedStrategy.blocked)}
    Path(args.out).write_text(json.dumps(result))
leave_process_group()
