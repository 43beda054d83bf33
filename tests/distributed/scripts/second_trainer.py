"""One module fitted by two Trainers in turn, each with a new FiveDStrategy (staged fine-tuning's way).

    second_trainer.py --cases JSON --out FILE

Each case: the reference model from seed 0, fitted for ``steps`` steps under ``first`` and then,
with a new Trainer, for ``steps`` more under ``second`` (FiveDStrategy keyword arguments). Rank 0
writes each case's trained full parameters, or the error the second fit raised
(tests/distributed/test_second_trainer.py).
"""

import os

import lightning as L

import lightning_5d
from lightning_5d.config import LayoutError
from tests_support import MODELS, RecordingLM, make_datamodule, run_cases_and_leave


def fit(model, options: dict, steps: int):
    strategy = lightning_5d.FiveDStrategy(bucket_size_mb=0.05, **options)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=int(os.environ["WORLD_SIZE"]),
                        precision="32-true", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, datamodule=make_datamodule())
    return strategy


def run(case: dict) -> dict:
    L.seed_everything(0, verbose=False)
    model = RecordingLM(config=MODELS["tiny"])
    fit(model, case["first"], case["steps"])
    try:
        strategy = fit(model, case["second"], case["steps"])
    except LayoutError as error:
        return {"error": str(error)}
    return {"params": {k: v.detach().clone() for k, v in strategy.full_model_state().items()}}


if __name__ == "__main__":
    run_cases_and_leave(run)
