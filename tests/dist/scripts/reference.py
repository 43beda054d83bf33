"""Single-process reference for the multi-process runs: same init, same batches, same steps.

Lightning re-samples training data with a shuffling DistributedSampler (seed 0, epoch 0),
so the union of the data ranks' k-th batches is ``perm[k*B*W:(k+1)*B*W]``.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from tests_support import BATCH_SIZE, TINY, RecordingLM, make_datamodule


def reference_run(steps: int, data_ranks: int, accumulate: int = 1, clip: float | None = None,
                  dtype: torch.dtype = torch.float32):  # fmt: skip
    L.seed_everything(0, verbose=False)
    model = RecordingLM(config=TINY).to(dtype)
    dm = make_datamodule()
    dm.setup("fit")
    dataset = dm.train_dataset
    optimizer = model.configure_optimizers()
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    global_batch = BATCH_SIZE * data_ranks
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulate):
            k = step * accumulate + micro
            batch = default_collate([dataset[i] for i in perm[k * global_batch : (k + 1) * global_batch]])
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return losses, model.state_dict()
