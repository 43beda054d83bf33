"""One start-up of the ~0.5 B model that loads weights: ``pretrained=`` (safetensors) or a resume.

Run by benchmarks/startup_memory_load.py under torch.distributed.run. The model is built on the
meta device (``trainer.init_module(empty_init=True)``) under ``FiveDStrategy(zero=3)`` or
``(tp=2, zero=3)``; the fit stops at ``on_train_start`` (after setup, the pretrained load, and
a resume's model and optimizer restore), before the next step. ``--variant save`` trains one
step and writes the sharded checkpoint the resume variants read (model + AdamW states).
Measured per rank as in startup_memory.py: RSS before the model exists, peak RSS until then.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
import lightning_5d  # noqa: E402
from lightning_5d.models import LlamaConfig, LlamaLM  # noqa: E402
from startup_memory import StopBeforeStep, rss_bytes, write_ranks_and_leave  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--variant", required=True, help="save | bare_<layout> | pretrained_<layout> | resume_<layout>")
parser.add_argument("--model", required=True, help="LlamaConfig fields as JSON")
parser.add_argument("--weights", required=True, help="the .safetensors file pretrained= reads")
parser.add_argument("--checkpoint", required=True, help="the sharded checkpoint `save` writes and `resume` reads")
parser.add_argument("--out", required=True)


def main() -> None:
    args = parser.parse_args()
    config = LlamaConfig(**json.loads(args.model))
    baseline = rss_bytes()
    v = args.variant
    tp = 2 if "tp2" in v else 1
    pretrained = args.weights if v.startswith("pretrained") else None
    strategy = lightning_5d.FiveDStrategy(zero=3, tp=tp, pretrained=pretrained)
    stop = StopBeforeStep()
    save = v == "save"
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        max_steps=1 if save else 2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[] if save else [stop])  # fmt: skip
    L.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):
        model = LlamaLM(config)
    ids = torch.randint(0, config.vocab_size, (64, 17))
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    resume = args.checkpoint if v.startswith("resume") else None
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2, drop_last=True), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(args.checkpoint)
    record = {"baseline": baseline, "peak": stop.peak, "rss_after_setup": rss_bytes()}
    write_ranks_and_leave(record, args.out)


if __name__ == "__main__":
    main()
