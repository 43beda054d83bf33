"""The zoo's ALiBi model (nested_lists: per-head slopes x token distances, causal mask folded
into a float attn_mask) under FiveDStrategy(cp=WORLD_SIZE): first-step loss and every
parameter's gradient against one process, for each sharding and ring mode.

Usage: cp_alibi_grads.py --out OUT_JSON [--cases zigzag:ring,contiguous:ring,zigzag:allgather]

Per case each rank trains one step (one data rank: the cp ranks share the batch) and records
the gradients the optimizer is handed (zero=0: the module's own, after the mean over dp x cp); the same
module, from the same seed, computes loss and gradients on the whole batch in one process.
Rank 0 writes, per case, the loss and the worst parameter's norm-relative gradient error.
"""

import argparse
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

import lightning_5d  # noqa: E402
import zoo  # noqa: E402
from lightning_5d.testing import leave_process_group  # noqa: E402
from tests_support import make_datamodule  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--cases", default="zigzag:ring,contiguous:ring,zigzag:allgather")
parser.add_argument("--model", default="nested_lists")
args = parser.parse_args()
WORLD = int(os.environ["WORLD_SIZE"])
BATCH = 2


class Gradients(L.Callback):
    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def one_process(module):
    """Loss and gradients of the first global batch (Lightning's sampler with one data rank)."""
    dm = make_datamodule(batch_size=BATCH)
    dm.setup("fit")
    perm = torch.randperm(len(dm.train_dataset), generator=torch.Generator().manual_seed(0)).tolist()
    batch = default_collate([dm.train_dataset[i] for i in perm[:BATCH]])
    loss = module.compute_loss(batch)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in module.named_parameters()}


records = []
for case in args.cases.split(","):
    sharding, mode = case.split(":")
    L.seed_everything(0, verbose=False)
    module = zoo.build(args.model)
    ref_loss, ref_grads = one_process(copy.deepcopy(module))
    grads = Gradients()
    strategy = lightning_5d.FiveDStrategy(cp=WORLD, zero=0, context={"sharding": sharding, "mode": mode})
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=WORLD, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[grads])  # fmt: skip
    trainer.fit(module, datamodule=make_datamodule(batch_size=BATCH))
    errors = {n: ((grads.grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    records.append({"case": case, "loss": module.losses[0].item(), "ref_loss": ref_loss, "params": len(errors),
                    "got_grads": len(grads.grads), "worst": worst, "worst_grad_error": errors[worst],
                    "attention": strategy.context_parallel.describe()})  # fmt: skip

if int(os.environ["RANK"]) == 0:
    Path(args.out).write_text(json.dumps(records, indent=1))
leave_process_group()
