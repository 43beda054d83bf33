"""``RunReport``: what a recipe run prints and records.

Every ``log_every`` optimizer steps rank 0 prints the step, the loss averaged over all
ranks, and throughput: global tokens per optimizer step divided by the step's wall
time. The first step (graph warm-up, allocator growth, lazy init) is left out of the
averages. At the end every rank measures the model state it holds
(:func:`lightning_5d.accounting.model_state_bytes`) and its peak RSS; rank 0 gathers
them, prints a per-rank table and one ``SUMMARY key=value ...`` line, and writes
``summary.json`` to the run directory.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_5d.accounting import ModelStateBytes, model_state_bytes

MIB = 1024 * 1024
_MEM_FIELDS = ("params", "grads", "optimizer", "peak_rss", "peak_accel")


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # KiB on Linux, bytes on macOS


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _loss_value(outputs: Any) -> Optional[float]:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().float())
    return None


def _batch_tokens(batch: Any) -> int:
    if isinstance(batch, dict):
        t = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    elif isinstance(batch, (list, tuple)) and batch:
        t = batch[0]
    else:
        t = batch
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0


class RunReport(Callback):
    """Progress lines, a per-rank memory table and ``summary.json`` for one run.

    Args:
        log_every: print every this many optimizer steps (0: only the summary).
        run_dir: where rank 0 writes ``summary.json`` (None: nowhere).
        tokens_per_step: global tokens per optimizer step. None: measured as this
            rank's tokens per step times the number of data-parallel ranks.
        info: extra key/values for the summary (layout, precision, recipe ...).
    """

    def __init__(
        self,
        log_every: int = 10,
        run_dir: str | Path | None = None,
        tokens_per_step: Optional[int] = None,
        info: Optional[dict[str, Any]] = None,
    ) -> None:
        self.log_every = int(log_every)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tokens_per_step = tokens_per_step
        self.info = dict(info or {})
        self._step = 0
        self._losses: list[float] = []  # micro-batch losses of the step in progress
        self._local_tokens = 0
        self._micro = 0
        self._last_loss: Optional[float] = None
        self._step_times: dict[int, float] = {}  # optimizer step -> time it finished
        self._history: list[dict[str, float]] = []
        self._t_start = 0.0
        self._state: Optional[ModelStateBytes] = None

    # ------------------------------------------------------------------ helpers
    def _mean_over_ranks(self, value: float, device: torch.device) -> float:
        rank, world = _world()
        if world == 1:
            return value
        t = torch.tensor([value if math.isfinite(value) else float("nan")], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item()) / world

    def _global_tokens(self, trainer: L.Trainer) -> int:
        if self.tokens_per_step is not None:
            return int(self.tokens_per_step)
        data_ranks = getattr(getattr(trainer.strategy, "_mesh", None), "data_size", None) or trainer.world_size
        return self._local_tokens * data_ranks

    def _tokens_per_s(self, trainer: L.Trainer, first: int, last: int) -> Optional[float]:
        """Throughput over steps ``first+1 .. last`` (the time from the end of ``first``)."""
        first = max(first, 1)  # step 1 is never timed
        if last <= first or first not in self._step_times or last not in self._step_times:
            return None
        dt = self._step_times[last] - self._step_times[first]
        return self._global_tokens(trainer) * (last - first) / dt if dt > 0 else None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        self._t_start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._micro == 0:  # first micro-batch of an optimizer step
            self._local_tokens = 0
        self._micro += 1
        self._local_tokens += _batch_tokens(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = _loss_value(outputs)
        if loss is not None:
            # Lightning hands back the loss divided by accumulate_grad_batches.
            self._losses.append(loss * trainer.accumulate_grad_batches)
        if trainer.global_step == self._step:
            return  # still accumulating
        self._step = trainer.global_step
        self._micro = 0
        self._step_times[self._step] = time.perf_counter()
        self._last_loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
        self._losses = []
        if self.log_every > 0 and self._step % self.log_every == 0:
            self._log_line(trainer, pl_module)

    def _log_line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = self._mean_over_ranks(self._last_loss, pl_module.device)
        prev = self._history[-1]["step"] if self._history else 0
        tps = self._tokens_per_s(trainer, int(prev), self._step)
        self._history.append({"step": self._step, "loss": loss, "tokens_per_s": tps})
        # The FP8 numerics guard's latest check (FiveDPrecision numerics_check_every), already a dp mean.
        guard = trainer.callback_metrics.get("fp8/loss_rel_diff")
        if guard is not None:
            self._history[-1]["fp8_loss_rel_diff"] = float(guard)
        if trainer.global_rank == 0:
            total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
            rate = f"{tps:,.0f}" if tps is not None else "-"
            check = f"  fp8 vs bf16 loss {float(guard):.3%}" if guard is not None else ""
            print(f"[l5d] step {self._step}{total}  loss {loss:.4f}  tokens/s {rate}{check}", flush=True)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Model state peaks here (gradients complete, optimizer states allocated): the moment
        # the ZeRO accounting describes. Optimizer states exist from the second step on and
        # the sizes do not change after it, so later steps need no recount.
        if trainer.global_step <= 1:
            self._state = model_state_bytes(pl_module, trainer.optimizers)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wall_s = time.perf_counter() - self._t_start
        final_loss = self._mean_over_ranks(
            self._last_loss if self._last_loss is not None else float("nan"), pl_module.device
        )
        tps = self._tokens_per_s(trainer, 1, self._step)
        state = self._state or model_state_bytes(pl_module, trainer.optimizers)
        accel = torch.cuda.max_memory_allocated() if pl_module.device.type == "cuda" else 0
        mine = [state.params, state.grads, state.optimizer, peak_rss_bytes(), accel]
        table = self._gather(mine, pl_module.device)
        if trainer.global_rank != 0:
            return
        rows = [dict(zip(("rank",) + _MEM_FIELDS, [r] + vals)) for r, vals in enumerate(table)]
        for row in rows:
            row["model_state"] = row["params"] + row["grads"] + row["optimizer"]
        summary = {
            "loss": final_loss,
            "tokens_per_s": tps,
            "steps": self._step,
            "tokens_per_step": self._global_tokens(trainer),
            "world_size": trainer.world_size,
            "wall_s": wall_s,
            "peak_rss_mib_max": max(r["peak_rss"] for r in rows) / MIB,
            "model_state_mib_max": max(r["model_state"] for r in rows) / MIB,
            **self.info,
            "history": self._history,
            "memory": rows,
        }
        print(self._memory_table(rows), flush=True)
        print(self._summary_line(summary), flush=True)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
            tmp.replace(self.run_dir / "summary.json")

    def _gather(self, values: list[int], device: torch.device) -> list[list[int]]:
        rank, world = _world()
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        if world == 1:
            return [values]
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine)
        return [[int(x) for x in t.tolist()] for t in out]

    @staticmethod
    def _memory_table(rows: list[dict[str, int]]) -> str:
        accel = any(r["peak_accel"] for r in rows)
        head = ["rank", "params", "grads", "optimizer", "model_state", "peak_rss"] + (["peak_accel"] if accel else [])
        lines = ["[l5d] memory per rank (MiB): model state held before an optimizer step; process peak RSS"]
        lines.append("".join(f"{h:>12}" for h in head))
        for r in rows:
            cells = [f"{r['rank']:>12}"] + [f"{r[k] / MIB:>12.2f}" for k in head[1:]]
            lines.append("".join(cells))
        return "\n".join(lines)

    @staticmethod
    def _summary_line(s: dict[str, Any]) -> str:
        def fmt(key: str, v: Any) -> str:
            if v is None:
                return "none"
            if isinstance(v, float):
                return f"{v:.4f}" if key == "loss" else f"{v:.1f}"
            return str(v).replace(" ", "")

        keys = ["loss", "tokens_per_s", "peak_rss_mib_max", "model_state_mib_max", "steps", "world_size"]
        keys += [k for k in s if k not in keys and k not in ("history", "memory", "wall_s", "tokens_per_step", "sizes")]
        return "SUMMARY " + " ".join(f"{k}={fmt(k, s[k])}" for k in keys)
