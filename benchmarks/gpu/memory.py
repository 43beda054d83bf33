"""Part 4: what one GPU holds while training the part 1 model, against ``l5d estimate`` for the same layout.

One ``Trainer(strategy=FiveDStrategy(), precision="bf16-mixed")`` fit, nothing else resident.
Measured, from the tensors themselves (``lightning_5d.accounting``, the counters the project's
accounting tests use): parameters, gradients and optimizer state (fp32 masters, Adam moments) just
before the second optimizer step, and the bytes autograd saves for backward during the second
step's forward (parameters excluded). On a GPU also the peak allocated bytes of every step
(``torch.cuda.max_memory_allocated``, reset at each step's start); the first step, which creates the
optimizer states, is reported apart from the steady ones.

The planner's numbers come from running ``l5d estimate --json`` on the same model (written as a
Hugging Face config.json next to the results) with dp 1 and the ZeRO stage that runs on one rank.
Targets: the tolerances of tests/distributed/test_accounting.py, 2 % for model state and 15 % for
activations; the peak against the planner's total gets the activations' 15 %.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import lightning as L
import torch

from benchmarks.gpu.hardware import Card, peak_allocated, reset_peak, sync
from benchmarks.gpu.part import PartContext, size, table, verdict
from benchmarks.gpu.workload import Sizes, build_data, build_module, make_trainer, write_hf_config

STATE_TOLERANCE = 0.02
ACTIVATION_TOLERANCE = 0.15
PEAK_TOLERANCE = 0.15
COMPONENTS = {"params": STATE_TOLERANCE, "grads": STATE_TOLERANCE, "optimizer": STATE_TOLERANCE,
              "activations": ACTIVATION_TOLERANCE}  # fmt: skip


class MemoryProbe(L.Callback):
    """Per-step peak allocation, the second step's saved activations and the model state before its update."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_peaks: list[int | None] = []
        self.activation_bytes: int | None = None
        self.state: dict[str, float] | None = None
        self._meter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_5d.accounting import SavedActivationMeter

        sync(self.device)
        reset_peak(self.device)
        if batch_idx == 1:  # the first step also creates the optimizer states: measure a steady one
            self._meter = SavedActivationMeter().__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.activation_bytes, self._meter = self._meter.bytes, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning_5d.accounting import model_state_bytes

        if trainer.global_step == 1:  # optimizer states exist since the first step
            self.state = model_state_bytes(pl_module, trainer.optimizers).as_dict()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync(self.device)
        self.step_peaks.append(peak_allocated(self.device))


def planner_cli(argv: list[str]) -> dict[str, Any]:
    """``l5d estimate ... --json``, run in this process; its JSON."""
    from lightning_5d.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"`l5d {' '.join(argv)}` exited with {code}: {printed.getvalue()[-500:]}")
    return json.loads(printed.getvalue())


def planner_argv(config_path: str, sizes: Sizes, zero: int) -> list[str]:
    return ["estimate", "--model", config_path, "--seq", str(sizes.seq), "--mbs", str(sizes.batch),
            "--dp-shard", "1", "--zero", str(zero), "--precision", "bf16", "--json"]  # fmt: skip


def zero_that_runs(configured: int) -> int:
    """On one rank ZeRO-1/2 have no engine (nothing to shard: plain training, ZeRO-0), while ZeRO-3 still
    wraps the model in FSDP2 with fp32 shards (FiveDStrategy._parallelize)."""
    return 3 if configured == 3 else 0


def measure(ctx: PartContext) -> dict[str, Any]:
    sizes, device = ctx.sizes, ctx.device
    steps = 1 + sizes.memory_steps
    probe = MemoryProbe(device)
    trainer = make_trainer(device, steps, [probe])
    trainer.fit(build_module(sizes, device), datamodule=build_data(sizes, steps))
    if probe.state is None or probe.activation_bytes is None:
        raise RuntimeError(f"the fit ended before its second step ({steps} steps asked)")
    zero = zero_that_runs(int(trainer.strategy.config.zero))  # the stage the planner in the Trainer chose
    argv = planner_argv(str(write_hf_config(sizes, ctx.out)), sizes, zero)
    planned_gib = planner_cli(argv)["memory_gib"]
    planned = {k: v * 2**30 for k, v in planned_gib.items()}
    measured = {k: probe.state[k] for k in ("params", "grads", "optimizer")}
    measured["activations"] = probe.activation_bytes
    steady = [p for p in probe.step_peaks[1:] if p is not None]
    peak = max(steady) if steady else None
    met = {k: abs(measured[k] - planned[k]) <= tol * planned[k] for k, tol in COMPONENTS.items()}
    met["peak"] = None if peak is None else abs(peak - planned["total"]) <= PEAK_TOLERANCE * planned["total"]
    return {
        "command": "l5d " + " ".join(argv),
        "measured": measured,
        "planned": planned,
        "peak_allocated_bytes": peak,
        "first_step_peak_bytes": probe.step_peaks[0],
        "step_peaks": probe.step_peaks,
        "met": met,
        "targets": {**COMPONENTS, "peak": PEAK_TOLERANCE},
    }


def markdown(r: dict[str, Any], sizes: Sizes, card: Card) -> list[str]:
    rows = []
    for key, tol in COMPONENTS.items():
        m, p = r["measured"][key], r["planned"][key]
        rows.append([key, size(m), size(p), f"{m / p:.3f}", f"within {tol:.0%}", verdict(r["met"][key])])
    total = r["planned"]["total"]
    peak = r["peak_allocated_bytes"]
    rows.append(["peak allocated per step (steady) vs planner total", size(peak), size(total),
                 "n/a" if peak is None else f"{peak / total:.3f}", f"within {PEAK_TOLERANCE:.0%}",
                 verdict(r["met"]["peak"])])  # fmt: skip
    lines = [
        "Model state counted from the tensors before the second optimizer step; activations: bytes autograd saved "
        "during the second step's forward (parameters excluded); peak: `torch.cuda.max_memory_allocated`, reset at "
        f"every step's start, the steps after the first. Planner: `{r['command']}` (the model's config.json is "
        "written next to the results).",
        "",
        *table(["", "measured", "planner", "measured / planner", "target", ""], rows),
        "",
        f"First step (creates the optimizer states): peak {size(r['first_step_peak_bytes'])}.",
    ]
    if peak is None:
        lines.append("Peak allocated bytes are a CUDA allocator figure: not measured on CPU.")
    return lines
