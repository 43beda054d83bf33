"""One pipeline-parallel training run of the reference model; the idle fraction of each stage per step.

Started by ``benchmarks/pipeline_bubble.py`` with ``lightning_5d.testing.run_distributed``
(torchrun, gloo, one process per pipeline rank, no data parallelism: world = pp). The strategy
is built as a user would: ``FiveDStrategy(pp=P, zero=1, pipeline={...})`` on an unchanged
``LlamaLM``; one Lightning batch is one pipeline run of m microbatches.

Measured on each rank, per step, from ``trainer.strategy.pipeline.times`` (the runtime's own
``StageTimes``) read in ``on_train_batch_end``:

- ``busy_s``: wall time inside this rank's stage computations (forward, backward, and the
  weight-gradient backward of the split-backward schedules), summed over its stages;
- ``wall_s``: wall time of the whole pipeline run (``schedule.step``: compute, point-to-point
  waits, the schedule's own Python); the optimizer step is outside it;
- ``bubble`` = 1 - busy / wall: the idle fraction of this rank;
- ``peak_in_flight``: the most microbatches each local stage held between forward and backward.

Also, per kind of stage computation (F: forward; B: full backward; Bi: input-gradient backward
and W: weight-gradient backward, for the split-backward schedules), the number of calls, their
wall time and the CPU time of the rank's main thread in them (``time.thread_time``; with one
intra-op thread, CPU autograd runs the backward on the calling thread). For that the worker
wraps the three methods of ``lightning_5d.parallel.pipeline.stage.TimedStage`` that time ``busy_s``,
calling them unchanged; their wall times add up to ``busy_s``. ``busy_s / busy_cpu_s`` is how
much the stage computations were stretched by waiting for a core: about 1 on a core of one's
own, up to ~2 with two ranks per core, more when other work shares the machine. And the main
thread's CPU time over the whole pipeline run (``PipelineParallel.run``, wrapped the same way):
what it spends outside the stage computations is the schedule's own work (its Python, posting
and completing the point-to-point transfers), which ``bubble`` counts as idle.

The first ``--warmup`` steps are not recorded (schedule construction, the activation-shape
probe, allocator warm-up). Rank 0 writes one JSON with every rank's numbers.

Oversubscription: the benchmark machine may have fewer cores than ranks (pp=4 on 2 cores). Each
rank runs one intra-op thread, but only as many stages as there are cores compute at a time, so
while all stages are busy (steady state) each computes at a fraction of a core and its busy time
is stretched, while in the ramp-up / drain phases, with ranks idle, the few busy ones run at full
speed. The measured busy / wall then reflects the core sharing as well as the schedule's
dependencies; the ``busy_s / busy_cpu_s`` ratio shows by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
from lightning_5d.testing import leave_process_group

KINDS = ("F", "B", "Bi", "W")


class StageComputeMeter:
    """Calls, wall and main-thread CPU seconds per kind of stage computation, for the current step."""

    def __init__(self) -> None:
        self.reset()
        self.hooked = self._hook()

    def reset(self) -> None:
        self.run_cpu = 0.0  # main-thread CPU over the whole pipeline run (PipelineParallel.run)
        self.calls = {k: 0 for k in KINDS}
        self.wall = {k: 0.0 for k in KINDS}
        self.cpu = {k: 0.0 for k in KINDS}

    def _hook(self) -> bool:
        from lightning_5d.parallel.pipeline import stage as pipeline

        stage = getattr(pipeline, "TimedStage", None)
        names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        if stage is None or not all(name in vars(stage) for name in names):
            return False
        meter = self

        def wrap(original, kind_of):
            def timed(*args, **kwargs):
                kind = kind_of(args, kwargs)
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    meter.calls[kind] += 1
                    meter.wall[kind] += time.perf_counter() - wall
                    meter.cpu[kind] += time.thread_time() - cpu

            return timed

        def backward_kind(args, kwargs):  # (self, bwd_chunk_id, loss=None, full_backward=True, ...)
            full = kwargs["full_backward"] if "full_backward" in kwargs else (args[3] if len(args) > 3 else True)
            return "B" if full else "Bi"

        original_run = pipeline.PipelineParallel.run

        def run(*args, **kwargs):
            cpu = time.thread_time()
            try:
                return original_run(*args, **kwargs)
            finally:
                meter.run_cpu += time.thread_time() - cpu

        pipeline.PipelineParallel.run = run
        stage.forward_one_chunk = wrap(stage.forward_one_chunk, lambda a, k: "F")
        stage.backward_one_chunk = wrap(stage.backward_one_chunk, backward_kind)
        stage.backward_weight_one_chunk = wrap(stage.backward_weight_one_chunk, lambda a, k: "W")
        return True


class RecordPipeline(L.Callback):
    def __init__(self, warmup: int, meter: StageComputeMeter) -> None:
        self.warmup = warmup
        self.meter = meter
        self.steps: list[dict] = []
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter.reset()
        self._cpu_start = time.thread_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx < self.warmup:
            return
        t = trainer.strategy.pipeline.times
        m = self.meter
        self.steps.append(
            {
                "busy_s": t.busy_s,
                "wall_s": t.wall_s,
                "bubble": t.bubble,
                "busy_cpu_s": sum(m.cpu.values()) if m.hooked else None,
                "run_cpu_s": m.run_cpu if m.hooked else None,
                "kinds": {k: {"calls": m.calls[k], "wall_s": m.wall[k], "cpu_s": m.cpu[k]} for k in KINDS}
                if m.hooked
                else None,
                "step_thread_cpu_s": time.thread_time() - self._cpu_start,  # the whole step, optimizer included
                "peak_in_flight": {str(k): v for k, v in t.peak_in_flight.items()},
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--model", required=True, help="LlamaConfig fields as JSON")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatch-size", type=int, default=1, help="samples per microbatch")
    parser.add_argument("--warmup", type=int, default=2, help="steps not recorded")
    parser.add_argument("--steps", type=int, default=4, help="recorded steps after the warm-up")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    torch.set_num_threads(1)
    meter = StageComputeMeter()

    L.seed_everything(0, verbose=False)
    model = LlamaLM(LlamaConfig(**json.loads(args.model)))
    batch = args.microbatch_size * args.microbatches  # one Lightning batch = one pipeline run
    total = args.warmup + args.steps
    data = TextDataModule(seq_len=args.seq_len, batch_size=batch, val_samples=1, num_samples=batch * total)
    strategy = lightning_5d.FiveDStrategy(
        pp=world,
        zero=1,
        pipeline={
            "schedule": args.schedule,
            "microbatches": args.microbatches,
            "virtual_stages": args.virtual_stages,
            "log_bubble": True,
        },
    )
    record = RecordPipeline(args.warmup, meter)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    pipe = trainer.strategy.pipeline
    mine = {
        "rank": dist.get_rank(),
        "stages": [s.index for s in pipe.specs],
        "blocks": {str(s.index): [s.blocks.start, s.blocks.stop] for s in pipe.specs},
        "steps": record.steps,
        "bubble_median": statistics.median(s["bubble"] for s in record.steps),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        result = {
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "pp": world,
            "describe": pipe.describe(),
            "logged_pp_bubble": float(trainer.callback_metrics["pp_bubble"]),  # the last step, mean over ranks
            "bubble": statistics.mean(r["bubble_median"] for r in ranks),  # median over steps, mean over ranks
            "ranks": ranks,
        }
        Path(args.out).write_text(json.dumps(result))
    leave_process_group()  # see benchmarks/workers/train.py


if __name__ == "__main__":
    main()
