"""What watching the user's training_step for parameter reads costs a step, side by side in one run.

    python -m benchmarks.step_watch_cost            # prints its RESULTS.md section

One fit of the reference model (``SMALL``: hidden 256, 4 layers) under ``FiveDStrategy(tp=2,
sequence_parallel=True)`` on 2 CPU processes (gloo, fp32, ``OMP_NUM_THREADS=1``), batch 4 x 128
tokens. The watch (``lightning_5d/parameter_reads.py``) is a ``TorchFunctionMode`` on the stack
while the step's own code runs, plus a forward pre-hook and a forward hook on every module of
the model that take it off while the module runs. The worker alternates steps with the watch
(hooks on, the step wrapped) and without it (hooks removed, the step unwrapped); both ranks
switch on the same steps. Ratios: median step time with the watch over the median without, in
wall time and this process's CPU time, so a shared machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

from benchmarks.common import (
    BATCH,
    SEQ_LEN,
    SMALL,
    alternating_fit,
    alternating_head,
    alternating_main,
    paired,
    ratio_cell,
    write_ranks,
)


def worker(args: argparse.Namespace) -> None:
    import lightning_5d
    from lightning_5d.applied import AppliedDimensions

    state = {"on": True, "hooks": 0}
    watched = AppliedDimensions.watched_training_step

    def switched(self, module):
        return watched(self, module) if state["on"] else nullcontext()

    AppliedDimensions.watched_training_step = switched

    def switch(trainer, on: bool) -> None:
        watch = trainer.strategy._applied._parameter_watch
        assert watch is not None, "tp=2 must be watched"
        state["on"] = on
        watch.add_hooks() if on else watch.remove()
        state["hooks"] = max(state["hooks"], len(watch._hooks))

    strategy = lightning_5d.FiveDStrategy(tp=2, sequence_parallel=True, verify="off")
    module, rows = alternating_fit(strategy, switch, args.pairs)
    write_ranks({"rows": rows, "modules": sum(1 for _ in module.modules()), "hooks": state["hooks"]}, args.out)


def summarize(ranks: list[dict]) -> dict:
    return {"ranks": [{**paired(r["rows"]), "modules": r["modules"], "hooks": r["hooks"]} for r in ranks]}


def markdown(result: dict, wall_s: float) -> str:
    first = result["ranks"][0]
    lines = [
        *alternating_head("step_watch_cost", wall_s),
        f"The watch on the user's `training_step` (`lightning_5d/parameter_reads.py`: a `TorchFunctionMode` "
        f"on the stack while the step's own code runs, {first['hooks']} forward hooks on the model's "
        f"{first['modules']} modules) against the same steps without it, alternating in one fit: tp=2 with SP, "
        f"the reference model ({SMALL}), batch {BATCH} x {SEQ_LEN} tokens, 2 CPU processes (gloo). Medians over "
        f"{first['steps_each']} steps of each kind; step = the whole Lightning step.",
        "",
        "| rank | step with / without the watch | step CPU with / without |",
        "|---|---:|---:|",
    ]
    for i, r in enumerate(result["ranks"]):
        lines.append(f"| {i} | {ratio_cell(r)} | {ratio_cell(r, 'step_cpu')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    alternating_main(Path(__file__), worker, summarize, markdown, "with the watch")


if __name__ == "__main__":
    sys.exit(main())
