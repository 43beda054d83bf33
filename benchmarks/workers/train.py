"""One benchmark training run of the reference model on every rank of a torchrun job.

Started by the benchmarks with ``lightning_5d.testing.run_distributed`` (torchrun; Lightning
sees torchelastic and launches nothing). Only public APIs: the strategies are built the way
a user would build them, and the hand-sharded and hand tensor-parallel variants are
ordinary LightningModule subclasses with a ``configure_model``. Rank 0 writes one JSON with
every rank's numbers.

Measured on each rank:
- step times: from the end of one step to the end of the next, for the timed steps after
  ``warmup`` (allocator, lazy init and first gathers excluded); whole loop iterations, so
  Lightning's own per-batch work is inside. The run's step time is the median step; the
  process CPU time of the same steps is recorded beside it;
- model-state bytes (``lightning_5d.accounting.model_state_bytes``) in
  ``on_before_optimizer_step`` of the second step, once the optimizer states exist;
- peak RSS of the process (``ru_maxrss``) and its RSS just before ``fit``;
- with ``--count-comm``: every collective launched during the timed steps
  (``lightning_5d.collectives.CollectiveCounter`` for ``torch.distributed`` calls,
  :class:`FunctionalCollectiveCounter` for DTensor's functional collectives);
- with ``--measure-activations``: the bytes autograd saves for backward during the first
  micro-batch's forward (``lightning_5d.accounting.SavedActivationMeter``, from the start of
  batch 0 to its backward; parameters excluded), on the untimed first warm-up step.

Tokens per step are ``batch_size * seq_len * (world / (tp * cp))``: tp and cp ranks share a
micro-batch (cp ranks each hold ``seq_len / cp`` of its tokens).
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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_5d
from lightning_5d.accounting import SavedActivationMeter, model_state_bytes
from lightning_5d.collectives import CollectiveCall, CollectiveCounter, wire_bytes
from lightning_5d.models import LlamaConfig, LlamaLM, TextDataModule
from lightning_5d.models.llama import TransformerBlock
from lightning_5d.testing import leave_process_group

STRATEGIES = ("5d", "ddp", "fsdp", "mp_fsdp", "mp_tp")


class HandShardedLM(LlamaLM):
    """What a user writes for ModelParallelStrategy: ``fully_shard`` per block, then the root."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # Lightning calls training_step, not forward: shard the inner model


class HandTensorParallelLM(LlamaLM):
    """What a user writes for ModelParallelStrategy's tensor parallelism: torch's ``parallelize_module``
    with the plan of Lightning's tensor-parallel example (taken from torchtitan), on this model's names.

    q/k/v and gate/up column-wise, o and down row-wise; the embedding row-wise (vocabulary-sharded)
    and the head column-wise with gathered (replicated) logits, as the example does. With sequence
    parallelism, the norms are ``SequenceParallel`` and each attention / MLP input is gathered by a
    ``PrepareModuleInput``. The attention module reshapes with ``-1`` heads, so unlike the example's
    model no head count needs dividing by tp.
    """

    sequence_parallel = False

    def configure_model(self):
        mesh = self.device_mesh["tensor_parallel"]
        sp = self.sequence_parallel
        top = {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
        }
        if sp:
            top["norm"] = SequenceParallel()
            top["layers.0"] = PrepareModuleInput(
                input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True
            )
        parallelize_module(self.model, mesh, top)
        for block in self.model.layers:
            plan = {
                "attention.q_proj": ColwiseParallel(),
                "attention.k_proj": ColwiseParallel(),
                "attention.v_proj": ColwiseParallel(),
                "attention.o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            }
            if sp:
                plan["attention_norm"] = SequenceParallel()
                plan["mlp_norm"] = SequenceParallel()
                plan["attention"] = PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                )
                plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            parallelize_module(block, mesh, plan)


class HandSequenceParallelLM(HandTensorParallelLM):
    sequence_parallel = True


def build_strategy(args):
    if args.strategy == "5d":
        extra = {} if args.bucket_mb is None else {"bucket_size_mb": args.bucket_mb}
        if args.tp > 1:
            extra.update(tp=args.tp, sequence_parallel=args.sp)
        if args.cp > 1:
            context = {"mode": args.cp_mode, "sharding": args.cp_sharding, "ulysses": args.cp_ulysses}
            extra.update(cp=args.cp, context=context)
        return lightning_5d.FiveDStrategy(zero=args.zero, dp_replicate=args.dp_replicate, **extra)
    if args.strategy == "ddp":
        return DDPStrategy()
    if args.strategy == "fsdp":
        # Full shard, one FSDP unit per transformer block: the configuration the Lightning docs recommend.
        return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={TransformerBlock})
    if args.strategy == "mp_fsdp":
        return ModelParallelStrategy(data_parallel_size=args.world, tensor_parallel_size=1)
    if args.strategy == "mp_tp":
        return ModelParallelStrategy(data_parallel_size=args.world // args.tp, tensor_parallel_size=args.tp)
    raise ValueError(args.strategy)


class FunctionalCollectiveCounter(TorchDispatchMode):
    """Records torch's functional collectives, which ``CollectiveCounter`` does not see.

    DTensor redistributes (and so torch's tensor-parallel styles communicate) through
    ``torch.ops._c10d_functional``, not through the ``torch.distributed`` functions that
    ``CollectiveCounter`` wraps; a dispatch mode sees those ops on their plain tensors. The two
    never see the same call: ``dist.*`` reaches ``torch.ops.c10d``, not the functional ops.
    Calls are recorded as ``CollectiveCall``s whose ``api`` starts with ``functional.``, with the
    same wire-byte convention. Only for counting runs: every op passes through Python.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []
        f = torch.ops._c10d_functional
        # op -> (kind, bytes of B from (args, output), group size from args)
        self.ops = {
            f.all_reduce.default: ("all_reduce", lambda a, out: _nbytes(a[0]), lambda a: _group_size(a[2])),
            f.all_gather_into_tensor.default: ("all_gather", lambda a, out: _nbytes(out), lambda a: a[1]),
            f.reduce_scatter_tensor.default: ("reduce_scatter", lambda a, out: _nbytes(a[0]), lambda a: a[2]),
            f.all_to_all_single.default: ("all_to_all", lambda a, out: _nbytes(a[0]), lambda a: _group_size(a[3])),
            f.broadcast.default: ("broadcast", lambda a, out: _nbytes(a[0]), lambda a: _group_size(a[2])),
        }
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before subclasses: let DTensor turn the op into local ops and
            # collectives first (as torch's CommDebugMode does), then see those.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        spec = self.ops.get(func)
        if spec is not None:
            kind, size, group = spec
            n, b = group(args), size(args, out)
            self.calls.append(CollectiveCall(f"functional.{func.__name__}", kind, n, b, wire_bytes(kind, b, n)))
        elif func.namespace == "_c10d_functional" and func.__name__.split(".")[0] not in (
            "wait_tensor",
            "_wrap_tensor_autograd",
        ):
            self.unknown.add(func.__name__)  # a collective not converted to bytes: reported, not dropped
        return out


def _nbytes(t) -> int:
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()


def _group_size(group) -> int:
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    return dist.distributed_c10d._resolve_process_group(group).size()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Measure(L.Callback):
    def __init__(self, warmup: int, steps: int, count_comm: bool, measure_activations: bool = False) -> None:
        self.warmup, self.steps = warmup, steps
        self.measure_activations = measure_activations
        self.activation_bytes: int | None = None
        self._meter: SavedActivationMeter | None = None
        self.counter = CollectiveCounter() if count_comm else None
        self.functional = FunctionalCollectiveCounter() if count_comm else None
        self.state_bytes: dict | None = None
        self.marks: list[float] = []  # perf_counter at the end of step warmup-1, warmup, ..., last
        self.cpu_marks: list[float] = []  # process CPU time (all threads) at the same moments
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0 and self.measure_activations:  # the first micro-batch's forward (a warm-up step)
            self._meter = SavedActivationMeter().__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.activation_bytes, self._meter = self._meter.bytes, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 1:  # the 2nd step: optimizer states exist since the 1st
            self.state_bytes = model_state_bytes(pl_module, trainer.optimizers).as_dict()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))  # rank 0's loss: paired variants must train alike
        # The window runs from the end of the last warm-up step to the end of the last step:
        # whole loop iterations, including what Lightning does between batches.
        if batch_idx < self.warmup - 1:
            return
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())
        if batch_idx == self.warmup - 1 and self.counter is not None:
            self.counter.start()
            self.functional.__enter__()
        elif batch_idx == self.warmup + self.steps - 1 and self.counter is not None:
            self.functional.__exit__(None, None, None)
            self.counter.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (5d, mp_tp)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism with --tp (5d, mp_tp)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (5d)")
    parser.add_argument("--cp-mode", default="ring", choices=["ring", "allgather", "alltoall", "hybrid"],
                        help="with --cp > 1")  # fmt: skip
    parser.add_argument("--cp-ulysses", type=int, default=None, help="cp ranks per all-to-all group (hybrid)")
    parser.add_argument("--cp-sharding", default="zigzag", choices=["zigzag", "contiguous"], help="with --cp > 1")
    parser.add_argument("--bucket-mb", type=float, default=None, help="5d bucket size (default: the strategy's)")
    parser.add_argument("--model", required=True, help="LlamaConfig fields as JSON")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per data rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--count-comm", action="store_true")
    parser.add_argument("--measure-activations", action="store_true", help="saved-activation bytes of batch 0")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.world = int(os.environ["WORLD_SIZE"])
    assert args.warmup >= 2, "model-state bytes are read in the 2nd step, which must not be timed"
    assert args.cp == 1 or args.strategy == "5d", "--cp is a FiveDStrategy setting"
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    torch.set_num_threads(1)

    L.seed_everything(0, verbose=False)
    if args.strategy == "mp_tp":
        cls = HandSequenceParallelLM if args.sp else HandTensorParallelLM
    else:
        cls = HandShardedLM if args.strategy == "mp_fsdp" else LlamaLM
    model = cls(LlamaConfig(**json.loads(args.model)))
    total_steps = args.warmup + args.steps
    # cp ranks read the same samples: the dataset (so the sampler's shuffle) must not grow with cp,
    # or a cp run would train on other samples than the cp=1 run it is compared with.
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, val_samples=1,
                          num_samples=args.batch_size * (args.world // args.cp) * total_steps)  # fmt: skip
    measure = Measure(args.warmup, args.steps, args.count_comm, args.measure_activations)
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
        "losses": measure.losses,
        "activation_bytes": measure.activation_bytes,
        "comm": [asdict(c) for c in measure.counter.calls + measure.functional.calls] if measure.counter else None,
        "comm_unknown": sorted(measure.functional.unknown) if measure.counter else None,
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        # Per step: tp and cp ranks share one micro-batch (both strategies give them the same samples).
        tokens = args.batch_size * args.seq_len * (args.world // (args.tp * args.cp))
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
    # while a peer is still using them (Lightning's own strategies do not tear them down), and
    # rarely even after they are destroyed, when device meshes and autograd contexts are
    # finalized (README, Known issues): barrier, destroy, then exit without interpreter teardown.
    leave_process_group()


if __name__ == "__main__":
    main()
