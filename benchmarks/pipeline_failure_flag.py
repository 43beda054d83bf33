"""What the pipeline's training failure flag costs a normal step, side by side in one run.

    python -m benchmarks.pipeline_failure_flag            # prints its RESULTS.md section

One fit of the reference model (``SMALL``: hidden 256, 4 layers) under
``FiveDStrategy(pp=2, pipeline={"schedule": "1f1b", "microbatches": 4})`` on 2 CPU processes
(gloo, fp32, ``OMP_NUM_THREADS=1``), batch 4 x 128 tokens. The flag is
``lightning_5d.parallel.pipeline.failure.StepFailures.agree`` (one all-reduce of one integer
over the world per pipeline run) plus one attribute test per stage computation. The worker
alternates steps with and without the flag's all-reduce (both ranks skip it on the same
steps, so no collective is left unmatched; no step fails here), and times each pipeline run
(``PipelineParallel.run``), each whole Lightning step (optimizer included) and each flag
exchange, in wall time and (steps) this process's CPU time. Ratios: median of the steps with
the flag over median without, so a shared machine's load hits both alike; and the flag's
median time over the median step. The exchange's time on the last stage's rank is mostly
waiting: 1F1B ends with the first stage's last backward, which the last stage's rank now waits
for before its optimizer step (gloo's broadcast of the results, which follows, does not make
its sender wait; on NCCL the same broadcast already orders the sender's later kernels behind
the first stage's arrival).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    BATCH,
    SEQ_LEN,
    SMALL,
    WARMUP,
    alternating_fit,
    alternating_head,
    alternating_main,
    paired,
    ratio_cell,
    write_ranks,
)

MICROBATCHES = 4


def worker(args: argparse.Namespace) -> None:
    import lightning_5d
    from lightning_5d.parallel.pipeline import stages
    from lightning_5d.parallel.pipeline.failure import StepFailures

    state = {"flag_on": True, "run_s": 0.0}
    flag_s: list[float] = []
    agree = StepFailures.agree

    def switched_agree(self, device):
        if not state["flag_on"]:
            self.own = None  # nothing failed in this benchmark; the run's state resets as agree would
            return
        start = time.perf_counter()
        try:
            agree(self, device)
        finally:
            flag_s.append(time.perf_counter() - start)

    StepFailures.agree = switched_agree
    run = stages.PipelineParallel.run

    def timed_run(self, *a, **k):
        start = time.perf_counter()
        try:
            return run(self, *a, **k)
        finally:
            state["run_s"] = time.perf_counter() - start

    stages.PipelineParallel.run = timed_run

    def switch(trainer, on: bool) -> None:
        state["flag_on"] = on

    strategy = lightning_5d.FiveDStrategy(
        pp=2, zero=1, verify="off", pipeline={"schedule": "1f1b", "microbatches": MICROBATCHES}
    )
    _, rows = alternating_fit(strategy, switch, args.pairs, extra=lambda: {"run_s": state["run_s"]})
    write_ranks({"rows": rows, "flag_s": flag_s[WARMUP:]}, args.out)


def summarize(ranks: list[dict]) -> dict:
    """Per rank (a pipeline step ends when its slowest rank does)."""
    per_rank = []
    for r in ranks:
        row = paired(r["rows"], ("step_s", "step_cpu_s", "run_s"))
        row["flag_s"] = statistics.median(r["flag_s"])
        row["flag_over_step"] = row["flag_s"] / row["step_off_s"]
        per_rank.append(row)
    return {"ranks": per_rank}


def markdown(result: dict, wall_s: float) -> str:
    lines = [
        *alternating_head("pipeline_failure_flag", wall_s),
        f"The training failure flag of the pipeline (`parallel/pipeline/failure.py`: one all-reduce of one "
        f"integer over the world per pipeline run) against the same steps without it, alternating in one fit: "
        f"pp=2, 1F1B, m={MICROBATCHES}, the reference model ({SMALL}), batch {BATCH} x {SEQ_LEN} tokens, 2 CPU "
        f"processes (gloo). Medians over {result['ranks'][0]['steps_each']} steps of each kind; run = "
        f"`PipelineParallel.run` (schedule, flag, results' broadcast), step = the whole Lightning step.",
        "",
        "| rank | step with / without flag | run with / without flag | step CPU with / without | flag exchange | flag / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(result["ranks"]):
        lines.append(f"| {i} | {ratio_cell(r)} | "
                     f"{r['run_ratio']:.3f} | {r['step_cpu_ratio']:.3f} | {r['flag_s'] * 1e3:.2f} ms | "
                     f"{r['flag_over_step']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    alternating_main(Path(__file__), worker, summarize, markdown, "with the flag")


if __name__ == "__main__":
    sys.exit(main())
