"""Zoo-matrix cells (tests/distributed/test_zoo_matrix.py), one after another in the same processes.

Each cell builds a zoo model (tests/zoo, in its own LightningModule) from seed 0 (eagerly, or under
``trainer.init_module(empty_init=True)`` for the ``(meta)`` layouts) and trains it under FiveDStrategy
with the cell's layout. Per cell, in ``<out>/<cell id>/``:

- trained: rank 0 writes ``result.json`` ({"losses", "seconds"}) and ``params.pt``;
- refused (every rank raised an error of lightning_5d's own before finishing): rank 0 writes
  ``result.json`` ({"refused": message, "steps_run"}); the processes go on with the next cell.
  When the message carries a ``model_plan:`` snippet without ``<placeholders>``, the cell is
  run once more with that plan (the advice), into ``<cell id>/advice/``;
- crashed (any other exception): each rank that got one writes ``error_rank<r>.json`` and
  exits, because a failure deep in torch may leave a peer inside a collective or state
  behind; the driver (zoo_matrix.py) records the crash and starts the next cell in fresh
  processes. A cell that trains with a wrong loss is also rerun alone in fresh processes;
- hung: a watchdog writes ``hang_rank<r>.txt`` and exits after ``--cell-limit`` seconds.
"""

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the zoo package

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_5d  # noqa: E402
import zoo  # noqa: E402
from lightning_5d.process_exit import _EXIT  # noqa: E402
from lightning_5d.testing import leave_process_group  # noqa: E402
from tests_support import RecordReturned, make_datamodule  # noqa: E402
from zoo_matrix import advice_plan, cause, is_refusal  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--cells", required=True, help="JSON list of cells (see zoo_matrix.py)")
parser.add_argument("--out", required=True)
parser.add_argument("--cell-limit", type=float, default=120.0, help="seconds before a cell counts as hung")
args = parser.parse_args()
WORLD = int(os.environ["WORLD_SIZE"])  # Lightning's environment may drop it at teardown
RANK = int(os.environ["RANK"])


class Watchdog:
    """Ends this process when the current cell runs past its limit (a hang in a collective)."""

    def __init__(self):
        self.deadline, self.where = None, None
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, where: Path, seconds: float) -> None:
        self.where, self.deadline = where, time.monotonic() + seconds

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.deadline is not None and time.monotonic() > self.deadline:
                with open(self.where / f"hang_rank{RANK}.txt", "w") as out:
                    out.write(f"no result after {args.cell_limit:.0f} s\n")
                    out.flush()
                    faulthandler.dump_traceback(file=out, all_threads=True)  # where it waited
                os._exit(4)


def meet_peers() -> None:
    """Go on to the next cell only if every rank got here and nothing of this cell is left active
    (a rank still inside a collective, or a torch function mode or saved-tensor hooks left
    entered by a forward that raised, ends the processes; the driver starts afresh)."""
    _EXIT.failed = False
    try:
        if torch._C._len_torch_function_stack() > 0:
            raise RuntimeError("a torch function mode is still active")
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # Left entered by a forward that raised: it would pack the next cell's tensors.
            raise RuntimeError("saved-tensor hooks are still active")
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    except Exception as error:
        print(f"rank {RANK}: leaving after the cell ({error})", file=sys.stderr, flush=True)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)


def run_cell(cell: dict, out: Path, watchdog: Watchdog, model_plan: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    watchdog.arm(out, args.cell_limit)
    if RANK == 0:
        (out / "started").write_text("")
    L.seed_everything(0, verbose=False)
    meta = cell.get("build") == "meta"
    module = None if meta else zoo.build(cell["model"])
    pipeline = {"microbatches": cell["batch_size"]} if cell["pp"] > 1 else {}
    returned = RecordReturned()
    status: dict = {"rank": RANK}
    start = time.perf_counter()
    try:  # the strategy's and the plugin's own checks may refuse too
        strategy = lightning_5d.FiveDStrategy(
            tp=cell["tp"], cp=cell["cp"], pp=cell["pp"], sequence_parallel=cell["sp"], zero=cell["zero"],
            bucket_size_mb=0.05, pipeline=pipeline, model_plan=model_plan,
        )  # fmt: skip
        precision, plugins = "32-true", []
        if cell["precision"] != "32-true":
            precision, plugins = None, [lightning_5d.FiveDPrecision.from_string(cell["precision"])]
        trainer = L.Trainer(accelerator="cpu", strategy=strategy, plugins=plugins, devices=WORLD, precision=precision,
                            max_steps=cell["steps"], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[returned])  # fmt: skip
        if meta:  # parameters on meta; each rank materializes its pieces with the eager build's values
            with trainer.init_module(empty_init=True):
                module = zoo.build(cell["model"])
        trainer.fit(module, datamodule=make_datamodule(batch_size=cell["batch_size"]))
    except Exception as error:
        info = {"type": type(error).__name__, "message": str(error), "refusal": is_refusal(error), "cause": cause(error),
                "steps_run": len(module.losses if module is not None else []) + len(returned.losses), "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
        (out / f"error_rank{RANK}.json").write_text(json.dumps(info, indent=1))
        if not info["refusal"]:
            # Recovering in these processes once let a later cp cell hang (twice in ~20 cp cells
            # after crashes; never in fresh processes): the driver goes on in fresh ones.
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(1)
        status["refused"] = info
    seconds = time.perf_counter() - start
    meet_peers()
    statuses = [None] * WORLD
    dist.all_gather_object(statuses, status)
    refused = [s["refused"] for s in statuses if "refused" in s]
    if refused:
        first = refused[0]
        if RANK == 0:
            result = {"refused": first["message"], "type": first["type"], "steps_run": first["steps_run"],
                      "ranks_refused": len(refused)}  # fmt: skip
            (out / "result.json").write_text(json.dumps(result, indent=1))
        plan = advice_plan(first["message"], cell["heads"])
        if model_plan is None and plan is not None and not any("<" in k + v for k, v in plan.items()):
            run_cell(cell, out / "advice", watchdog, model_plan=plan)
        return
    losses = torch.stack(module.losses if cell["pp"] == 1 else returned.losses).float()
    dist.all_reduce(losses, group=strategy.mesh.group("dp"))
    losses /= strategy.mesh.data_size
    state = strategy.full_model_state()
    if RANK == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "params.pt")
        result = {"losses": losses.tolist(), "seconds": seconds, "model_plan": model_plan}
        (out / "result.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    watchdog = Watchdog()
    for cell in json.loads(Path(args.cells).read_text()):
        run_cell(cell, Path(args.out) / cell["id"], watchdog)
    watchdog.deadline = None
    leave_process_group()


main()
