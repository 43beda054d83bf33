"""What a user's steps hand to Lightning under tp, cp and pp: metrics and predictions.

    step_edges.py --cases JSON --out FILE

Each case: a model (``tiny``: the reference model; otherwise a zoo model, tests/zoo) built from
seed 0, then with one Trainer and FiveDStrategy(**layout): ``validate`` (2 batches),
``predict`` (2 batches) and ``fit`` (1 step). The steps are what a user writes for one process:
accuracy from the logits' argmax logged with ``sync_dist``, ``log_dict``, ``self.all_gather``
(unless the case says the step does not run on every rank), the logits and tokens returned
from ``predict_step``. Rank 0 writes, per case, the validate results, the first training
step's logged metrics, the predictions, and the type of every value Lightning or a callback
received (tests/distributed/test_step_edges.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchmetrics  # noqa: E402

import lightning_5d  # noqa: E402
import zoo  # noqa: E402
from tests_support import MODELS, RecordingLM, make_datamodule, run_cases_and_leave  # noqa: E402


class TypesSeen(L.Callback):
    """The type names of what Lightning hands callbacks: step outputs and the logged metrics."""

    def __init__(self):
        self.types: set[str] = set()

    def _record(self, trainer, outputs):
        values = list(outputs.values()) if isinstance(outputs, dict) else [outputs]
        values += list(trainer.callback_metrics.values())
        self.types.update(type(v).__name__ for v in values)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer, outputs)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._record(trainer, outputs)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._record(trainer, outputs)


def top32_hits(logits, labels):
    """Whether each label is among the 32 likeliest tokens: ~1/8 at random init, where argmax accuracy is 0."""
    return (logits.topk(32, dim=-1).indices == labels.unsqueeze(-1)).any(-1).float()


class OneProcessSteps:
    """Steps as written for one process, on top of a model's ``logits(input_ids)``."""

    gather = True  # self.all_gather in the step: every rank must run it (not so under pp)
    partial_rank0 = False

    def metrics(self, batch):
        logits = self.logits(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        accuracy = (logits.argmax(-1) == batch["labels"]).float().mean()
        return logits, loss, accuracy

    def training_step(self, batch, batch_idx):
        logits, loss, accuracy = self.metrics(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", accuracy, sync_dist=True)  # 0 at the start: the next one tells more
        self.log("train_top_prob", logits.detach().softmax(-1).amax(-1).mean(), sync_dist=True)
        self.log("train_top32", top32_hits(logits, batch["labels"]).mean(), sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        logits, loss, accuracy = self.metrics(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", accuracy, sync_dist=True)
        self.log("val_acc_unsynced", accuracy)
        self.log("val_top32", top32_hits(logits, batch["labels"]).mean(), sync_dist=True)
        self.log_dict({"val_mean_prob": logits.softmax(-1).amax(-1).mean()})
        # Combined over microbatches (pp), sequence shards (cp) and batches by their reduce_fx.
        self.log("val_top_logit", logits.max(), reduce_fx="max")
        self.log("val_top32_hits", top32_hits(logits, batch["labels"]).sum(), reduce_fx=torch.sum)
        # Summed over the data ranks (one here): tp, cp and pp peers hold the same value, not more data.
        self.log("val_top32_hits_synced", top32_hits(logits, batch["labels"]).sum(), reduce_fx="sum", sync_dist=True)
        # Integers count their part (microbatch, sequence shard): the batch's count is the parts' sum.
        self.log("val_top32_count", top32_hits(logits, batch["labels"]).sum().long())
        self.log("val_samples", len(batch["input_ids"]))  # a Python int: the same on every cp shard
        self.log("val_acc_rank0", accuracy, rank_zero_only=True)  # replicated over tp: no collective
        # torchmetrics objects: updated here, synced and logged at the epoch's end (under pp a metric
        # object cannot be logged from inside the step: only its last stage updates it).
        self.metric_hits.update(top32_hits(logits, batch["labels"]).sum())
        self.metric_acc(logits.argmax(-1), batch["labels"])
        if self.partial_rank0:  # a max over the sharded vocabulary needs every tp rank: refused
            self.log("val_top_logit_rank0", logits.max(), rank_zero_only=True)
        if self.gather:
            tokens = self.all_gather(logits.argmax(-1))
            self.log("val_gathered_tokens", float(tokens.numel()))
        return {"loss": loss, "accuracy": accuracy}

    def on_validation_epoch_end(self):
        self.log("val_metric_hits", self.metric_hits.compute())
        self.log("val_metric_acc", self.metric_acc.compute())
        self.metric_hits.reset()
        self.metric_acc.reset()

    def predict_step(self, batch, batch_idx):
        logits = self.logits(batch["input_ids"])
        return {"logits": logits, "tokens": logits.argmax(-1)}


class ReferenceLogits:
    def logits(self, input_ids):
        return self(input_ids)


def build(name: str) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    if name == "tiny":
        module = RecordingLM(config=MODELS["tiny"])
        bases = (OneProcessSteps, ReferenceLogits, type(module))
    else:
        module = zoo.build(name)
        bases = (OneProcessSteps, type(module))
    module.__class__ = type(f"Edges{type(module).__name__}", bases, {})
    module.metric_hits = torchmetrics.SumMetric()
    module.metric_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=256, average="micro")
    return module


def run(case: dict) -> dict:
    module = build(case["model"])
    module.gather = case.get("gather", True)
    module.partial_rank0 = case.get("partial_rank0", False)
    seen = TypesSeen()
    trainer = L.Trainer(accelerator="cpu", strategy=lightning_5d.FiveDStrategy(**case["layout"]),
                        devices=int(os.environ["WORLD_SIZE"]), precision="32-true", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, limit_predict_batches=2, num_sanity_val_steps=0,
                        callbacks=[seen])  # fmt: skip
    datamodule = make_datamodule()
    result = {"validate": {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule)[0].items()}}
    if case.get("predict", True):
        predictions = trainer.predict(module, dataloaders=datamodule.val_dataloader())
        result["predict"] = [{k: v.detach().clone() for k, v in p.items()} for p in predictions]
        result["predict_types"] = sorted({type(v).__name__ for p in predictions for v in p.values()})
    trainer.fit(module, datamodule=datamodule)
    result["train"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result["types"] = sorted(seen.types)
    # Lightning's callbacks vote over every rank (EarlyStopping: any; ModelCheckpoint: all).
    strategy, first = trainer.strategy, trainer.global_rank == 0
    result["votes"] = {"any": strategy.reduce_boolean_decision(first, all=False),
                       "all": strategy.reduce_boolean_decision(first, all=True),
                       "all of True": strategy.reduce_boolean_decision(True, all=True)}  # fmt: skip
    return result


if __name__ == "__main__":
    run_cases_and_leave(run)
