"""A model whose parameters are used differently on each rank, and one expert no rank uses.

Each batch picks one expert from its first sample, so ranks touch different parameters
in the same step; every parameter gets its own gradient bucket, so buckets become ready
in a different order on each rank. Expert 2 is never used: under AdamW's weight decay
it must stay exactly as initialized, as in one process. ``--manual-accumulate K`` runs
manual optimization with ``manual_backward`` on every batch and a step every K batches.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_5d

NUM_SAMPLES, BATCH, DIM = 64, 2, 8  # 16 batches per epoch: no test crosses an epoch


class Samples(Dataset):
    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, i):
        x = torch.randn(DIM, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        return x, i % 2  # which expert the batch goes to, if this sample comes first


class Routed(L.LightningModule):
    def __init__(self, manual_accumulate: int = 0):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 1)
        self.manual_accumulate = manual_accumulate
        self.automatic_optimization = manual_accumulate == 0
        self.losses = []

    def loss(self, x, which):
        return self.head(torch.tanh(self.experts[int(which[0])](x))).pow(2).mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(*batch)
        self.losses.append(loss.detach().clone())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.manual_accumulate)
        if (batch_idx + 1) % self.manual_accumulate == 0:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=BATCH, shuffle=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, required=True)
    parser.add_argument("--manual-accumulate", type=int, default=0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    L.seed_everything(0)
    model = Routed(args.manual_accumulate)
    strategy = lightning_5d.FiveDStrategy(zero=args.zero, bucket_size_mb=1e-6)  # one parameter per bucket
    trainer = L.Trainer(accelerator="cpu", devices=int(__import__("os").environ["WORLD_SIZE"]),
                        strategy=strategy, precision="64-true", max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model)
    losses = torch.stack(model.losses)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(args.out) / "params.pt")
        (Path(args.out) / "losses.json").write_text(json.dumps(losses.tolist()))
