"""Record which dataset indices each rank trains on during one epoch."""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import lightning_5d


class Indices(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i], dtype=torch.float32)


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen += batch.flatten().long().tolist()
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=4, shuffle=True)


model = Recorder()
strategy = lightning_5d.FiveDStrategy(dp_replicate=int(sys.argv[2]), zero=0)
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
trainer.fit(model)
seen = [None] * dist.get_world_size()
dist.all_gather_object(seen, {"seen": model.seen, "data_rank": strategy.mesh.data_rank, **trainer.distributed_sampler_kwargs})
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
