"""What a user's training_step computes from the parameters, under a layout, against one process.

    parameter_reads.py --cases JSON --out FILE

Each case trains the reference model (seed 0; ``tiny_moe`` with its MoE blocks) for 3 steps with
FiveDStrategy(**layout) (a world of one: one process) and a training_step written for one
process that adds a term computed from the parameters to the loss:

* ``l2``: ``1e-2 * sum(p.pow(2).sum() for p in self.parameters())``;
* ``norm_l2``: ``1e-1 * self.model.norm.weight.pow(2).sum()`` (one parameter, the last stage's);
* ``block_norm_l2``: ``self.model.layers[0].attention_norm.weight.pow(2).sum()`` (a norm weight whose
  gradient tp sums over its ranks under sequence parallelism);
* ``head_logits``: a second cross-entropy of ``F.linear(embeddings, self.model.lm_head.weight)``, the
  head's weight used outside its module (as a chunked cross-entropy does);
* ``first_block_l2``: ``1e-2 *`` the sum of squares of the embedding's and the first block's parameters,
  ``.full_tensor()`` of it where it is a DTensor (ZeRO-3);
* ``ema``: no term; an exponential moving average of every parameter kept in the step (element-wise).

``optimizer: "sgd"`` trains with SGD (lr 0.05), which shows a gradient counted twice (AdamW's update
hides a scale). Rank 0 writes, per case, the final full parameters, or the error that stopped the fit
(tests/distributed/test_parameter_reads.py).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import lightning_5d  # noqa: E402
from lightning_5d.parallel.pipeline import PipelinePeerError  # noqa: E402
from tests_support import MODELS, RecordingLM, make_datamodule, run_cases_and_leave  # noqa: E402

STEPS = 3


class PenalisedLM(RecordingLM):
    term = "l2"
    optimizer = "adamw"

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return super().configure_optimizers()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        model = self.model
        if self.term == "l2":
            loss = loss + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())
        elif self.term == "norm_l2":
            loss = loss + 1e-1 * model.norm.weight.pow(2).sum()
        elif self.term == "block_norm_l2":
            loss = loss + model.layers[0].attention_norm.weight.pow(2).sum()
        elif self.term == "head_logits":
            logits = F.linear(model.embed_tokens(batch["input_ids"]), model.lm_head.weight)
            loss = loss + 0.1 * F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        elif self.term == "first_block_l2":  # DTensors under ZeRO-3 (sharded units): whole by .full_tensor()
            first = [p for n, p in self.named_parameters() if n.startswith(("model.embed_tokens", "model.layers.0."))]
            total = sum(p.pow(2).sum() for p in first)
            loss = loss + 1e-2 * (total.full_tensor() if isinstance(total, DTensor) else total)
        elif self.term == "ema":
            with torch.no_grad():
                if not hasattr(self, "ema"):
                    self.ema = [p.detach().clone() for p in self.parameters()]
                for average, p in zip(self.ema, self.parameters()):
                    average.mul_(0.9).add_(p.detach(), alpha=0.1)
        return loss


def run(case: dict) -> dict:
    L.seed_everything(0, verbose=False)
    module = PenalisedLM(config=MODELS[case.get("model", "tiny")])
    module.term, module.optimizer = case["term"], case.get("optimizer", "adamw")
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", strategy=lightning_5d.FiveDStrategy(**case["layout"]), devices=world,
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    try:
        trainer.fit(module, datamodule=make_datamodule(batch_size=case.get("batch", 2)))
    except (lightning_5d.ParameterReadError, PipelinePeerError) as error:  # pp: the peer stage's refusal
        return {"error": f"{type(error).__name__}: {error}"}
    state = trainer.strategy.full_model_state()
    return {"params": {k: v.detach().clone() for k, v in state.items()}}


if __name__ == "__main__":
    run_cases_and_leave(run)
