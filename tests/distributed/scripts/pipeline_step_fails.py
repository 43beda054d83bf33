"""Training under pp=2 (x dp on more processes) where the user's step raises on one rank at step 2.

One fit per ``--cases`` entry, one after another in the same processes: each must end on
both ranks with the named error (the failing rank its own exception, the other a
PipelinePeerError naming the failing rank and that exception). A rank left waiting in a receive would hold up the next
fit, and the whole launch would run into the test's time limit instead. Each rank writes
``rank<r>.json``: per case, the exception's type, message and notes, and the seconds from
the failing step's start to the raise.
"""

import argparse
import json
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch.distributed as dist

import lightning_5d
from lightning_5d.testing import leave_process_group
from tests_support import TINY, RecordingLM, make_datamodule

FAIL_STEP = 2


class FailingLM(RecordingLM):
    """The reference model whose step raises on one rank at one step: before the model runs (a
    bad batch) or after it (a loss guard: it runs on the last stage's rank only)."""

    def __init__(self, where: str, rank: int, **kwargs):
        super().__init__(**kwargs)
        self.where, self.rank = where, rank
        self.step_started = None

    def on_train_batch_start(self, batch, batch_idx):
        self.step_started = time.monotonic()

    def training_step(self, batch, batch_idx):
        failing = dist.get_rank() == self.rank and batch_idx == FAIL_STEP
        if failing and self.where == "before_model":
            raise ValueError(f"bad batch at step {batch_idx} on rank {self.rank}")
        loss = super().training_step(batch, batch_idx)
        if failing and self.where == "after_model":
            raise FloatingPointError(f"loss guard tripped at step {batch_idx} on rank {self.rank}")
        return loss


def run_case(schedule: str, virtual_stages: int, where: str, rank: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = FailingLM(where, rank, config=replace(TINY, num_layers=4))
    strategy = lightning_5d.FiveDStrategy(
        pp=2,
        zero=1,
        pipeline={"schedule": schedule, "microbatches": 4, "virtual_stages": virtual_stages},
        timeout=timedelta(seconds=600),  # far past the test's limit: a hang fails the test, not the group
        verify="off",
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=FAIL_STEP + 2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    try:
        trainer.fit(model, datamodule=make_datamodule(batch_size=4))
    except Exception as err:  # noqa: BLE001 - the case's outcome, checked by the test
        return {
            "type": type(err).__name__,
            "message": str(err),
            "notes": list(getattr(err, "__notes__", [])),
            "peer_rank": getattr(err, "rank", None),
            "step": trainer.global_step,
            "seconds": time.monotonic() - model.step_started,
        }
    return {"type": None, "step": trainer.global_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="JSON list of [schedule, virtual_stages, where, failing rank]")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = {}
    for schedule, v, where, rank in json.loads(args.cases):
        records[f"{schedule}/{where}/{rank}"] = run_case(schedule, v, where, rank)
    Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(records))
    leave_process_group()


if __name__ == "__main__":
    main()
