"""Train a model under FiveDStrategy, optionally starting from pretrained weights, and save a checkpoint.

With ``--pretrained PATH`` the strategy loads that plain / Hugging Face state dict with
``lightning_5d.checkpoint.load_pretrained`` right after its setup (model parallelized,
optimizers created and sharded: where Lightning restores a ``ckpt_path``), or with
``--load-at parallelize`` right after parallelization, before the optimizers exist; rank 0 writes the full state
it then holds (``loaded.pt``). After training, every rank saves ``--out/last.ckpt`` with
``trainer.save_checkpoint`` (the strategy's default, sharded format), and rank 0 writes the
per-step losses (averaged over data ranks, ``result.json``) and the full final state
(``params.pt``). Losses and states are the LightningModule's; models: the reference model
(``tiny*``) or a Hugging Face model from a small config (``llama``, ``gpt2``, ``mixtral`` ...).
"""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from lightning_5d.checkpoint.pretrained import load_pretrained
from lightning_5d.testing import leave_process_group
from hf_support import CausalLM
from tests_support import MODELS, RecordReturned, RecordingLM, make_datamodule

HF_MODELS = ["llama", "qwen2", "gpt2", "mixtral", "qwen2_moe"]

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, choices=HF_MODELS + sorted(MODELS))
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--sp", action="store_true")
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1)
parser.add_argument("--zero", type=int, default=1)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--pretrained", default=None, help="a .safetensors / .pt file or a Hugging Face folder")
parser.add_argument("--prefix", default=None)
parser.add_argument(
    "--load-at",
    default="option",
    choices=["option", "setup", "parallelize"],
    help="FiveDStrategy(pretrained=...) (right after parallelization); or load_pretrained called after the "
    "strategy's setup (optimizers exist), or right after parallelization (before them)",
)
parser.add_argument("--weights-only", action="store_true", help="trainer.save_checkpoint(weights_only=True)")
parser.add_argument("--out", required=True)
args = parser.parse_args()
out = Path(args.out)

L.seed_everything(0)  # also the sampler's shuffling seed, which the single-process references replay
if args.pretrained:
    torch.manual_seed(1)  # another init: every weight the run trains from must come from the file
module = CausalLM(args.model, args.layers) if args.model in HF_MODELS else RecordingLM(config=MODELS[args.model])


def record_load(strategy, report) -> None:
    state = strategy.full_model_state()
    if dist.get_rank() == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out / "loaded.pt")
        (out / "load.json").write_text(json.dumps({"prefix": report.prefix, "bytes_read": report.bytes_read}))


class PretrainedStrategy(lightning_5d.FiveDStrategy):
    """load_pretrained called by hand at the two points it supports."""

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if args.load_at == "setup":
            self.load_pretrained()

    def _parallelize(self, module) -> None:
        super()._parallelize(module)
        if args.load_at == "parallelize":
            self.load_pretrained()

    def load_pretrained(self) -> None:
        if args.pretrained is not None:
            record_load(self, load_pretrained(self, args.pretrained, prefix=args.prefix))


class RecordOptionLoad(L.Callback):
    """FiveDStrategy(pretrained=...) loaded during setup; what the ranks hold before the first step."""

    def on_fit_start(self, trainer, pl_module):
        if trainer.strategy.pretrained_load is not None:
            record_load(trainer.strategy, trainer.strategy.pretrained_load)


layout = dict(tp=args.tp, sequence_parallel=args.sp, pp=args.pp, ep=args.ep, zero=args.zero, bucket_size_mb=0.05,
              pipeline={"microbatches": 2} if args.pp > 1 else None)  # fmt: skip
if args.load_at == "option":
    strategy = lightning_5d.FiveDStrategy(**layout, pretrained=args.pretrained, pretrained_prefix=args.prefix)
else:
    strategy = PretrainedStrategy(**layout)


returned = RecordReturned()
trainer = L.Trainer(
    accelerator="cpu",
    strategy=strategy,
    devices=int(os.environ["WORLD_SIZE"]),
    max_steps=args.steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    callbacks=[returned, RecordOptionLoad()],
)
trainer.fit(module, datamodule=make_datamodule())
trainer.save_checkpoint(out / "last.ckpt", weights_only=args.weights_only)
losses = torch.stack(returned.losses)
dist.all_reduce(losses, group=strategy.mesh.group("dp"))
losses /= strategy.mesh.data_size
state = strategy.full_model_state()
if dist.get_rank() == 0:
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, out / "params.pt")
    (out / "result.json").write_text(json.dumps({"losses": losses.tolist()}))
leave_process_group()
