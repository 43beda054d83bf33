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
import os
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from benchmarks.common import BATCH, SEQ_LEN, SMALL, alternating_fit, alternating_main, paired, write_ranks

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
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    first = result["ranks"][0]
    lines = [
        "## step_watch_cost",
        "",
        "- command: `python -m benchmarks.step_watch_cost`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; wall time {wall_s:.0f} s; load average at the end: {load}",
        "",
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
        lines.append(f"| {i} | {r['step_ratio']:.3f} ({r['step_on_s'] * 1e3:.0f} / {r['step_off_s'] * 1e3:.0f} ms) | "
                     f"{r['step_cpu_ratio']:.3f} ({r['step_cpu_on_s'] * 1e3:.0f} / {r['step_cpu_off_s'] * 1e3:.0f} ms) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    alternating_main(Path(__file__), worker, summarize, markdown, "with the watch")


if __name__ == "__main__":
    sys.exit(main())
