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
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from lightning_5d.testing import run_distributed

SMALL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
SEQ_LEN, BATCH, WARMUP = 128, 4, 3


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_5d
    from lightning_5d.applied import AppliedDimensions
    from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule

    torch.set_num_threads(1)
    state = {"on": True}
    watched = AppliedDimensions.watched_training_step

    def switched(self, module):
        return watched(self, module) if state["on"] else nullcontext()

    AppliedDimensions.watched_training_step = switched

    class Alternate(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.hooks = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            watch = trainer.strategy._applied._parameter_watch
            assert watch is not None, "tp=2 must be watched"
            state["on"] = batch_idx < WARMUP or batch_idx % 2 == 0
            watch.add_hooks() if state["on"] else watch.remove()
            self.hooks = max(self.hooks, len(watch._hooks))
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= WARMUP:
                self.rows.append({"on": state["on"], "step_s": time.perf_counter() - self.start,
                                  "step_cpu_s": time.process_time() - self.cpu})  # fmt: skip

    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig(**SMALL))
    timer = Alternate()
    strategy = lightning_5d.FiveDStrategy(tp=2, sequence_parallel=True, verify="off")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=WARMUP + 2 * args.pairs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=BATCH, num_samples=BATCH * (WARMUP + 2 * args.pairs))
    trainer.fit(module, datamodule=data)
    modules = sum(1 for _ in module.modules())
    mine = {"rows": timer.rows, "modules": modules, "hooks": timer.hooks}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(ranks))


def summarize(ranks: list[dict]) -> dict:
    per_rank = []
    for r in ranks:
        on = [x for x in r["rows"] if x["on"]]
        off = [x for x in r["rows"] if not x["on"]]
        row = {
            "steps_each": min(len(on), len(off)),
            "modules": r["modules"],
            "hooks": r["hooks"],
            "step_on_s": statistics.median(x["step_s"] for x in on),
            "step_off_s": statistics.median(x["step_s"] for x in off),
            "cpu_on_s": statistics.median(x["step_cpu_s"] for x in on),
            "cpu_off_s": statistics.median(x["step_cpu_s"] for x in off),
        }
        row["step_ratio"] = row["step_on_s"] / row["step_off_s"]
        row["cpu_ratio"] = row["cpu_on_s"] / row["cpu_off_s"]
        per_rank.append(row)
    return {"ranks": per_rank}


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
                     f"{r['cpu_ratio']:.3f} ({r['cpu_on_s'] * 1e3:.0f} / {r['cpu_off_s'] * 1e3:.0f} ms) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--pairs", type=int, default=20, help="steps with the watch and as many without")
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
