"""Single-process reference for the multi-process runs: same init, same batches, same steps.

Lightning re-samples training data with a shuffling DistributedSampler (seed 0, epoch 0),
so the union of the data ranks' k-th batches is ``perm[k*B*W:(k+1)*B*W]``.
"""

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from tests_support import BATCH_SIZE, MODELS, RecordingLM, make_datamodule, unfreeze_matching


def reference_run(steps: int, data_ranks: int, accumulate: int = 1, clip: float | None = None,
                  dtype: torch.dtype = torch.float32, num_samples: int | None = None, model: str = "tiny",
                  batch_size: int = BATCH_SIZE, aux_loss_coef: float = 0.0,
                  initial_state: dict | None = None, freeze: str | None = None,
                  unfreeze_at: int | None = None, optimizer_groups: str | None = None,
                  warmup_steps: int = 0):  # fmt: skip
    L.seed_everything(0, verbose=False)
    model = RecordingLM(config=MODELS[model], freeze=freeze, optimizer_groups=optimizer_groups,
                        warmup_steps=warmup_steps).to(dtype)  # fmt: skip
    if initial_state is not None:  # pretrained weights in place of the seeded initialization
        model.load_state_dict(initial_state)
    router_probs = []
    if aux_loss_coef:  # the Switch loss on the whole batch, written out independently of lightning_5d
        for block in model.model.layers:
            block.moe.router.register_forward_hook(lambda m, a, out: router_probs.append(out.float().softmax(-1)))
    dm = make_datamodule(num_samples)
    dm.setup("fit")
    dataset = dm.train_dataset
    optimizer, scheduler = model.configure_optimizers(), None
    if isinstance(optimizer, dict):  # with a per-step learning-rate schedule
        optimizer, scheduler = optimizer["optimizer"], optimizer["lr_scheduler"]["scheduler"]
    global_batch = batch_size * data_ranks
    batches_per_epoch = len(dataset) // global_batch
    losses = []
    for step in range(steps):
        if step == unfreeze_at:
            unfreeze_matching(model, freeze)
        optimizer.zero_grad()
        for micro in range(accumulate):
            epoch, k = divmod(step * accumulate + micro, batches_per_epoch)
            # The sampler reseeds every epoch with seed + epoch.
            perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
            batch = default_collate([dataset[i] for i in perm[k * global_batch : (k + 1) * global_batch]])
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            total = loss
            for probs in router_probs:
                E, k = probs.shape[-1], model.model.config.experts_top_k
                f = torch.bincount(probs.topk(k, dim=-1).indices.flatten(), minlength=E).float() / (len(probs) * k)
                total = total + aux_loss_coef * E * (f * probs.mean(0)).sum()
            router_probs.clear()
            (total / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return losses, model.state_dict()
