"""Labels with -100 spread unevenly over the batch (SFT prompts), under a layout, against one process.

    token_mean.py --cases JSON --out FILE

Each case trains the reference model (seed 0) for 3 steps with FiveDStrategy(**layout) on data whose
sample i has its first (7 i mod 29) targets masked with -100, so that data ranks, cp shards and
pipeline microbatches count different numbers of targets. ``labels`` says where the mask is:

* ``aligned``: in the batch's labels, aligned with input_ids (labels[t] = input_ids[t+1]);
* ``shifted``: in a ``labels`` equal to input_ids, which the step shifts (``logits[:, :-1]`` against
  ``labels[:, 1:]``), as Hugging Face's causal LMs do;
* ``in_step``: nowhere in the batch; the step masks the same targets itself;
* ``unmasked``: no target masked.

``model: "qwen3"``: the zoo's Hugging Face Qwen3 (``tests/zoo``), its loss computed inside the
model from ``labels=`` (``labels: "shifted"``), as Hugging Face's causal LMs do.
``reduction: "sum"`` trains on the cross-entropy's sum divided by the step's own count of targets
(the usual hand-written mean, and Hugging Face's with ``num_items_in_batch``), with SGD. ``checks``: the same mean cross-entropy computed under ``torch.no_grad()`` in each step.
``accumulate``: Lightning's accumulate_grad_batches. ``validate``: a
validation pass after the fit, its logged ``val_loss`` recorded. Rank 0 writes, per case, the final
full parameters, the logged losses and the val_loss, or the error that stopped the fit
(tests/distributed/test_token_mean.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_5d  # noqa: E402
from lightning_5d.parallel.pipeline import PipelinePeerError  # noqa: E402
from tests_support import RecordingLM, make_datamodule, run_cases_and_leave  # noqa: E402

STEPS = 3


def prompt_length(i: int) -> int:
    return (i * 7) % 29


class Prompted(Dataset):
    """The text windows with sample i's first prompt_length(i) targets masked (where ``labels`` says)."""

    def __init__(self, base: Dataset, labels: str) -> None:
        self.base, self.labels = base, labels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        item = dict(self.base[i])
        k = prompt_length(i)
        if self.labels == "unmasked":
            return item
        if self.labels == "aligned":
            item["labels"] = item["labels"].clone()
            item["labels"][:k] = -100
        elif self.labels == "shifted":  # labels[t] is input_ids[t]; target t+1 of the step is masked below k
            shifted = item["input_ids"].clone()
            shifted[: k + 1] = -100
            item["labels"] = shifted
        else:
            item["prompt"] = torch.tensor(k)
        return item


class PromptedData(L.LightningDataModule):
    def __init__(self, batch: int, labels: str) -> None:
        super().__init__()
        self.inner, self.batch, self.labels = make_datamodule(batch_size=batch), batch, labels

    def setup(self, stage=None) -> None:
        self.inner.setup(stage)

    def train_dataloader(self) -> DataLoader:
        data = Prompted(self.inner.train_dataset, self.labels)
        return DataLoader(data, batch_size=self.batch, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Prompted(self.inner.val_dataset, self.labels), batch_size=self.batch)


class PromptedLM(RecordingLM):
    labels = "aligned"
    reduction = "mean"

    def __init__(self) -> None:
        super().__init__()
        self.checks: list[float] = []

    def configure_optimizers(self):
        if self.reduction == "sum":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return super().configure_optimizers()

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["input_ids"])
        if self.labels == "shifted":
            logits, labels = logits[:, :-1], batch["labels"][:, 1:]
        elif self.labels == "in_step":
            labels = batch["labels"].clone()
            positions = torch.arange(labels.size(1), device=labels.device)
            labels[positions < batch["prompt"][:, None]] = -100
        else:
            labels = batch["labels"]
        if self.reduction == "mean":  # a value without gradients (a metric; the FP8 check's reference) matches
            with torch.no_grad():
                self.checks.append(float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=self.reduction)
        return loss / (labels != -100).sum() if self.reduction == "sum" else loss


def build(case: dict) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    if case.get("model") == "qwen3":
        import zoo

        module = zoo.build("qwen3")  # the model shifts labels=batch["labels"] and takes their mean itself
        module.compute_loss = lambda batch: module.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        module.labels = "shifted"
        return module
    module = PromptedLM()
    module.labels, module.reduction = case.get("labels", "aligned"), case.get("reduction", "mean")
    return module


def run(case: dict) -> dict:
    module = build(case)
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", strategy=lightning_5d.FiveDStrategy(**case["layout"]), devices=world,
                        max_steps=STEPS, accumulate_grad_batches=case.get("accumulate", 1), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    data = PromptedData(case.get("batch", 2), module.labels)
    try:
        trainer.fit(module, datamodule=data)
    except (lightning_5d.TokenMeanError, PipelinePeerError) as error:  # pp: the last stage's refusal
        return {"error": f"{type(error).__name__}: {error}"}
    out = {"params": {k: v.detach().clone() for k, v in trainer.strategy.full_model_state().items()},
           "losses": [float(x) for x in module.losses], "checks": list(getattr(module, "checks", [])),
           "logged": float(trainer.callback_metrics.get("train_loss", float("nan")))}  # fmt: skip
    if case.get("validate"):
        trainer.limit_val_batches = 2
        out["val_loss"] = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"])
    return out


if __name__ == "__main__":
    run_cases_and_leave(run)
