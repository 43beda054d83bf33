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
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lightning_5d.testing import run_distributed

SMALL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
SEQ_LEN, BATCH, MICROBATCHES, WARMUP = 128, 4, 4, 3


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_5d
    from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
    from lightning_5d.parallel.pipeline import stages
    from lightning_5d.parallel.pipeline.failure import StepFailures

    torch.set_num_threads(1)
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

    class Alternate(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            state["flag_on"] = batch_idx < WARMUP or batch_idx % 2 == 0
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= WARMUP:
                self.rows.append({"flag": state["flag_on"], "step_s": time.perf_counter() - self.start,
                                  "step_cpu_s": time.process_time() - self.cpu, "run_s": state["run_s"]})  # fmt: skip

    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig(**SMALL))
    timer = Alternate()
    strategy = lightning_5d.FiveDStrategy(
        pp=2, zero=1, verify="off", pipeline={"schedule": "1f1b", "microbatches": MICROBATCHES}
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=WARMUP + 2 * args.pairs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH, num_samples=BATCH * (WARMUP + 2 * args.pairs))
    trainer.fit(module, datamodule=data)
    mine = {"rows": timer.rows, "flag_s": flag_s[WARMUP:]}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))


def summarize(ranks: list[dict]) -> dict:
    """Per rank, then the slower rank's numbers (a pipeline step ends when its slowest rank does)."""
    per_rank = []
    for r in ranks:
        on = [x for x in r["rows"] if x["flag"]]
        off = [x for x in r["rows"] if not x["flag"]]
        row = {
            "steps_each": min(len(on), len(off)),
            "step_on_s": statistics.median(x["step_s"] for x in on),
            "step_off_s": statistics.median(x["step_s"] for x in off),
            "cpu_on_s": statistics.median(x["step_cpu_s"] for x in on),
            "cpu_off_s": statistics.median(x["step_cpu_s"] for x in off),
            "run_on_s": statistics.median(x["run_s"] for x in on),
            "run_off_s": statistics.median(x["run_s"] for x in off),
            "flag_s": statistics.median(r["flag_s"]),
        }
        row["step_ratio"] = row["step_on_s"] / row["step_off_s"]
        row["run_ratio"] = row["run_on_s"] / row["run_off_s"]
        row["cpu_ratio"] = row["cpu_on_s"] / row["cpu_off_s"]
        row["flag_over_step"] = row["flag_s"] / row["step_off_s"]
        per_rank.append(row)
    return {"ranks": per_rank}


def markdown(result: dict, wall_s: float) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "## pipeline_failure_flag",
        "",
        "- command: `python -m benchmarks.pipeline_failure_flag`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        f"- date: {time.strftime('%Y-%m-%d')}; wall time {wall_s:.0f} s; load average at the end: {load}",
        "",
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
        lines.append(f"| {i} | {r['step_ratio']:.3f} ({r['step_on_s'] * 1e3:.0f} / {r['step_off_s'] * 1e3:.0f} ms) | "
                     f"{r['run_ratio']:.3f} | {r['cpu_ratio']:.3f} | {r['flag_s'] * 1e3:.2f} ms | "
                     f"{r['flag_over_step']:.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--pairs", type=int, default=20, help="steps with the flag and as many without")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        from lightning_5d.testing import leave_process_group

        leave_process_group()
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = ["--worker", "--pairs", str(args.pairs), "--out", str(out)]
        launch = run_distributed(Path(__file__), 2, argv, timeout=900, env={"OMP_NUM_THREADS": "1"})
        if launch.returncode != 0 or not out.exists():
            raise RuntimeError(f"the worker failed:\n{launch.output[-3000:]}")
        result = summarize(json.loads(out.read_text()))
    print(json.dumps(result))
    print(markdown(result, time.perf_counter() - start))


if __name__ == "__main__":
    sys.exit(main())
