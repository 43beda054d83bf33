"""Train the hand-written LMs of ``discover_models`` under FiveDStrategy, several cases per launch.

``--cases FILE``: a JSON list of ``{"style", "layout": FiveDStrategy keywords, "fp8": bool,
"out": dir}``. Rank 0 writes ``result.json`` per case: the per-step losses (averaged over the
data ranks) or, for a layout refused during setup, ``{"refused": type, "message": text}``
(every rank raises the same refusal before any collective of the step, so the next case can run).
"""

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from lightning_5d.config import LayoutError
from lightning_5d.plan import ModelMappingError
from lightning_5d.testing import leave_process_group
from discover_models import HandLM
from tests_support import RecordReturned, make_datamodule


def run(case: dict) -> dict:
    L.seed_everything(0, verbose=False)
    module = HandLM(case["style"])
    layout = {"bucket_size_mb": 0.05, **case["layout"]}
    strategy = lightning_5d.FiveDStrategy(**layout)
    plugins = [lightning_5d.FiveDPrecision.from_string("fp8")] if case.get("fp8") else []
    returned = RecordReturned()
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        plugins=plugins,
        devices=int(os.environ["WORLD_SIZE"]),
        precision=None if plugins else "32-true",
        max_steps=case.get("steps", 3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[returned],
    )
    try:
        trainer.fit(module, datamodule=make_datamodule())
    except (ModelMappingError, LayoutError) as refused:
        if module.losses or returned.losses:
            raise  # refusals must come before training
        return {"refused": type(refused).__name__, "message": str(refused)}
    losses = torch.stack(returned.losses if layout.get("pp", 1) > 1 else module.losses)
    dist.all_reduce(losses, group=strategy.mesh.group("dp"))
    losses /= strategy.mesh.data_size
    return {"losses": losses.tolist(), "data_ranks": strategy.mesh.data_size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    for case in json.loads(Path(args.cases).read_text()):
        result = run(case)
        if dist.get_rank() == 0:
            out = Path(case["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "result.json").write_text(json.dumps(result))
    leave_process_group()


if __name__ == "__main__":
    main()
