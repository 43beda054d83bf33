"""What taking the step's cross-entropy over the whole batch costs a step, side by side in one run.

    python -m benchmarks.token_mean_cost            # prints its RESULTS.md section

One fit of the reference model (``SMALL``: hidden 256, 4 layers) under ``FiveDStrategy(zero=1)``
over 2 data ranks on 2 CPU processes (gloo, fp32, ``OMP_NUM_THREADS=1``), batch 4 x 128 tokens
per rank. With the token mean (``lightning_5d/parallel/token_mean.py``) the step's
``F.cross_entropy`` adds one all-reduce of two numbers over the data ranks (its value is the
batch's mean on every rank); without it each rank takes its own part's mean, as before. The
worker alternates steps with and without it; both ranks switch on the same steps. Ratios: median
step time with it over the median without, in wall time and this process's CPU time.
"""

from __future__ import annotations

import argparse
import sys
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

    state = {"on": True, "calls": 0}
    token_mean = AppliedDimensions._token_mean

    def switched(self, mode):
        found = token_mean(self, mode)
        state["calls"] += found is not None
        return found if state["on"] else None

    AppliedDimensions._token_mean = switched

    def switch(trainer, on: bool) -> None:
        state["on"] = on

    module, rows = alternating_fit(lightning_5d.FiveDStrategy(zero=1), switch, args.pairs)
    assert state["calls"] > 0, "dp=2 must take the token mean"
    write_ranks({"rows": rows}, args.out)


def summarize(ranks: list[dict]) -> dict:
    return {"ranks": [paired(r["rows"]) for r in ranks]}


def markdown(result: dict, wall_s: float) -> str:
    first = result["ranks"][0]
    lines = [
        *alternating_head("token_mean_cost", wall_s),
        f"The step's cross-entropy as the mean over the whole batch (`lightning_5d/parallel/token_mean.py`: one "
        f"all-reduce of (sum, count) over the data ranks per call) against each rank's own mean, alternating in one "
        f"fit: ZeRO-1 over 2 data ranks, the reference model ({SMALL}), batch {BATCH} x {SEQ_LEN} tokens per rank, "
        f"2 CPU processes (gloo). Medians over {first['steps_each']} steps of each kind; step = the whole "
        f"Lightning step.",
        "",
        "| rank | step with / without | step CPU with / without |",
        "|---|---:|---:|",
    ]
    for i, r in enumerate(result["ranks"]):
        lines.append(f"| {i} | {ratio_cell(r)} | {ratio_cell(r, 'step_cpu')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    alternating_main(Path(__file__), worker, summarize, markdown, "with the token mean")


if __name__ == "__main__":
    sys.exit(main())
