"""One benchmark training run of the reference model on every rank of a torchrun job.

Started by the benchmarks with ``lightning_5d.testing.run_distributed`` (torchrun; Lightning
sees torchelastic and launches nothing). Only public APIs: the strategies are built the way
a user would build them, and the hand-sharded variant is an ordinary LightningModule
subclass with a ``configure_model``. Rank 0 writes one JSON with every rank's numbers.

Measured on each rank:
- step times: from the end of one step to the end of the next, for the timed steps after
  ``warmup`` (allocator, lazy init and first gathers excluded); whole loop iterations, so
  Lightning's own per-batch work is inside. The run's step time is the median step; the
  process CPU time of the same steps is recorded beside it;
- model-state bytes (``lightning_5d.accounting.model_state_bytes``) in
  ``on_before_optimizer_step`` of the second step, once the optimizer states exist;
- peak RSS of the process (``ru_maxrss``) and its RSS just before ``fit``;
- with ``--count-comm``: every collective launched during the timed steps
  (``lightning_5d.collectives.CollectiveCounter``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import lightning_5d
from lightning_5d.accounting import model_state_bytes
from lightning_5d.collectives import CollectiveCounter
from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
from lightning_5d.models.llama import TransformerBlock

STRATEGIES = ("5d", "ddp", "fsdp", "mp_fsdp")


class HandShardedLM(LlamaLM):
    """What a user writes for ModelParallelStrategy: ``fully_shard`` per block, then the root."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # Lightning calls training_step, not forward: shard the inner model


def build_strategy(args):
    if args.strategy == "5d":
        extra = {} if args.bucket_mb is None else {"bucket_size_mb": args.bucket_mb}
        return lightning_5d.FiveDStrategy(zero=args.zero, dp_replicate=args.dp_replicate, **extra)
    if args.strategy == "ddp":
        return DDPStrategy()
    if args.strategy == "fsdp":
        # Full shard, one FSDP unit per transformer block: the configuration the Lightning docs recommend.
        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={TransformerBlock})
    if args.strategy == "mp_fsdp":
        return ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1)
    raise ValueError(args.strategy)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Measure(L.Callback):
    def __init__(self, warmup: int, steps: int, count_comm: bool) -> None:
        self.warmup, self.steps = warmup, steps
        self.counter = CollectiveCounter() if count_comm else None
        self.state_bytes: dict | None = None
        self.marks: list[float] = []  # perf_counter at the end of step warmup-1, warmup, ..., last
        self.cpu_marks: list[float] = []  # process CPU time (all threads) at the same moments

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 1:  # the 2nd step: optimizer states exist since the 1st
            self.state_bytes = model_state_bytes(pl_module, trainer.optimizers).as_dict()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # The window runs from the end of the last warm-up step to the end of the last step:
        # whole loop iterations, including what Lightning does between batches.
        if batch_idx < self.warmup - 1:
            return
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())
        if batch_idx == self.warmup - 1 and self.counter is not None:
            self.counter.start()
        elif batch_idx == self.warmup + self.steps - 1 and self.counter is not None:
            self.counter.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=None, help="5d bucket size (default: the strategy's)")
    parser.add_argument("--model", required=True, help="LlamaConfig fields as JSON")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per data rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--count-comm", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.world = int(os.environ["WORLD_SIZE"])
    assert args.warmup >= 2, "model-state bytes are read in the 2nd step, which must not be timed"
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    torch.set_num_threads(1)

    L.seed_everything(0, verbose=False)
    cls = HandShardedLM if args.strategy == "mp_fsdp" else LlamaLM
    model = cls(LlamaConfig(**json.loads(args.model)))
    total_steps = args.warmup + args.steps
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_samples=1,
                          num_samples=args.batch_size * args.world * total_steps)  # fmt: skip
    measure = Measure(args.warmup, args.steps, args.count_comm)
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=args.world, strategy=build_strategy(args), precision="32-true",
            max_steps=total_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[measure],
        )  # fmt: skip
    except ValueError as err:  # a strategy that refuses this machine (Lightning's FSDP wants CUDA)
        if os.environ["RANK"] == "0":
            Path(args.out).write_text(json.dumps({"unavailable": f"{type(err).__name__}: {err}"}))
        return
    rss_before_fit = rss_bytes()
    trainer.fit(model, datamodule=data)

    mine = {
        "step_times_s": [b - a for a, b in zip(measure.marks, measure.marks[1:])],
        "step_cpu_s": [b - a for a, b in zip(measure.cpu_marks, measure.cpu_marks[1:])],
        "model_state_bytes": measure.state_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_fit_bytes": rss_before_fit,
        "comm": [asdict(c) for c in measure.counter.calls] if measure.counter else None,
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        tokens = args.batch_size * args.seq_len * args.world  # per step; every rank is a data rank here
        # A step ends when its slowest rank ends it; the median step shrugs off a burst of
        # load from other work on a shared machine better than the mean does.
        steps = [max(times) for times in zip(*(r["step_times_s"] for r in ranks))]
        step_s = statistics.median(steps)
        # CPU seconds all ranks spent per step: the work done, nearly blind to other load on the machine.
        cpu_s = statistics.median(sum(cpus) for cpus in zip(*(r["step_cpu_s"] for r in ranks)))
        result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "tokens_per_s": tokens / step_s,
                  "step_s": step_s, "mean_step_s": sum(steps) / len(steps), "tokens_per_cpu_s": tokens / cpu_s,
                  "ranks": ranks}  # fmt: skip
        Path(args.out).write_text(json.dumps(result))
    # Leave together: gloo aborts a process whose groups are still alive at interpreter exit
    # while a peer is still using them (Lightning's own strategies do not tear them down).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
