"""Several layout-matrix cells, one after another, in the same processes.

Each cell is what train_hf.py does (a new module, FiveDStrategy and Trainer), but the
processes start once: importing torch, Lightning and transformers on every rank is most of
a small cell's cost. A cell the strategy refuses records the message and the number of
steps that ran; the next cell goes on. Rank 0 writes ``<out>/<cell id>/result.json``
(and ``params.pt`` when the cell trained).
"""

import argparse
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from hf_support import CausalLM
from lightning_5d.config import LayoutError
from lightning_5d.parallel.expert.moe import ExpertParallelError
from lightning_5d.process_exit import _EXIT
from lightning_5d.testing import leave_process_group
from tests_support import RecordReturned, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--cells", required=True, help="JSON list of cells (see test_layout_matrix.py)")
parser.add_argument("--out", required=True)
args = parser.parse_args()
WORLD = int(os.environ["WORLD_SIZE"])  # Lightning's environment may drop it at teardown


def run_cell(cell: dict, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = CausalLM(cell["model"], cell["layers"])
    strategy = lightning_5d.FiveDStrategy(
        tp=cell["tp"], cp=cell["cp"], sequence_parallel=cell["sp"], zero=cell["zero"], bucket_size_mb=0.05,
        pp=cell["pp"], ep=cell["ep"],
        pipeline={"schedule": cell["schedule"], "virtual_stages": cell["virtual_stages"],
                  "microbatches": cell["microbatches"]},
    )  # fmt: skip
    returned = RecordReturned()
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, devices=WORLD, precision="32-true",
                        max_steps=cell["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[returned])  # fmt: skip
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=make_datamodule(batch_size=cell["batch_size"]))
    except (LayoutError, ExpertParallelError) as error:  # refusals: on every rank alike, before a loss
        _EXIT.failed = False  # the peers are all here: the next cell may use the group
        dist.barrier()
        if dist.get_rank() == 0:
            result = {"refused": str(error), "steps_run": len(module.losses) + len(returned.losses)}
            (out / "result.json").write_text(json.dumps(result))
        return
    seconds = time.perf_counter() - start
    losses = torch.stack(module.losses if cell["pp"] == 1 else returned.losses)
    dist.all_reduce(losses, group=strategy.mesh.group("dp"))
    losses /= strategy.mesh.data_size
    state = strategy.full_model_state()
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "params.pt")
        (out / "result.json").write_text(json.dumps({"losses": losses.tolist(), "seconds": seconds}))


for cell in json.loads(Path(args.cells).read_text()):
    out = Path(args.out) / cell["id"]
    out.mkdir(parents=True, exist_ok=True)
    run_cell(cell, out)
leave_process_group()
