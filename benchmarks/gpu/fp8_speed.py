"""Part 2: FP8 recipes of our torch-native backend vs bf16 mixed, same model, same steps.

Each run is one ``Trainer(strategy=FiveDStrategy(), ...)`` fit from the same seed on the same
batches: bf16 mixed, or ``FiveDPrecision("fp8", recipe, fp8={"backend": "torch"})``, whose block
projections run their three GEMMs through ``torch._scaled_mm`` (per-tensor and row scales) on the
GPU's FP8 tensor cores. Runs alternate: ``fp8_rounds`` passes over bf16 and every recipe, the order
rotating each pass. tokens/s: the timed steps after ``warmup``, CUDA-synchronized; speed-up: the
recipe's over bf16's within each pass, median. Loss: the mean of the last ``loss_window`` steps of
the first pass, FP8 against bf16 (same steps, same batches).

A GEMM whose operands ``torch._scaled_mm`` refuses on this device falls back to emulation
(dequantize, fp32 matmul) and runs slower than bf16; such refusals are listed with the run. The
blockwise and MX recipes always take that path on this torch (``_scaled_mm`` takes no tile or MX
scales), so they are not timed unless asked for with ``--fp8-recipes``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch

from benchmarks.gpu.hardware import Card, peak_allocated, release_memory, reset_peak, sync
from benchmarks.gpu.part import PartContext, size, pct, table, verdict
from benchmarks.gpu.workload import Sizes, build_data, build_module, loss_of, make_trainer

TARGET_SPEEDUP = 1.3
TARGET_LOSS_REL = 0.01
TARGETED = ("tensorwise", "rowwise")  # the recipes the issue sets the speed-up target for
DEFAULT_RECIPES = ("tensorwise", "rowwise", "delayed")
EMULATED = ("blockwise", "mxfp8")
BF16 = "bf16"


class StepTimer(L.Callback):
    """Losses of every step (kept on the device until the end) and the synchronized time of the timed steps."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.losses: list[torch.Tensor] = []
        self.seconds: float | None = None
        self._start = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(loss_of(outputs))
        done = batch_idx + 1
        if done == self.warmup:
            sync(self.device)
            self._start = time.perf_counter()
        elif done == self.warmup + self.steps:
            sync(self.device)
            self.seconds = time.perf_counter() - self._start


def _refused() -> set:
    from lightning_5d.fp8 import linear

    return set(linear._scaled_mm_refused)


def run_once(variant: str, sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """One fit: ``variant`` is "bf16" or an FP8 recipe."""
    total = sizes.warmup + sizes.fp8_steps
    timer = StepTimer(sizes.warmup, sizes.fp8_steps, device)
    refused_before = _refused()
    release_memory(device)
    reset_peak(device)
    started = time.perf_counter()
    trainer = make_trainer(device, total, [timer], fp8_recipe=None if variant == BF16 else variant)
    trainer.fit(build_module(sizes, device), datamodule=build_data(sizes, total))
    if timer.seconds is None:
        raise RuntimeError(f"{variant}: the fit ended before its {total} steps")
    precision = trainer.strategy.precision_plugin
    fp8 = getattr(precision, "fp8", None) is not None
    return {
        "tokens_per_s": sizes.tokens_per_step * sizes.fp8_steps / timer.seconds,
        "losses": [float(x) for x in timer.losses],
        "peak_allocated_bytes": peak_allocated(device),
        "backend": precision.backend.value if fp8 else None,
        "fp8_linears": len(precision.fp8_names) if fp8 else 0,
        "scaled_mm_refused": sorted(str(k) for k in _refused() - refused_before),
        "wall_s": time.perf_counter() - started,
    }


def measure(ctx: PartContext) -> dict[str, Any]:
    sizes, device = ctx.sizes, ctx.device
    recipes = [r for r in ctx.fp8_recipes if r != BF16]
    variants = [BF16, *recipes]
    passes: list[dict[str, dict]] = []
    not_run: list[str] = []
    failed: dict[str, str] = {}  # a recipe that fails once is not tried again; the others still run
    longest = 0.0
    for p in range(sizes.fp8_rounds):
        shift = p % len(variants)
        done: dict[str, dict] = {}
        for variant in variants[shift:] + variants[:shift]:
            if variant in failed:
                continue
            if passes and not ctx.deadline.allows(longest):  # the first pass always runs whole
                not_run.append(f"pass {p + 1}: {variant}")
                continue
            try:
                done[variant] = run_once(variant, sizes, device)
            except Exception as err:  # e.g. out of memory, or a kernel this torch lacks for one recipe
                failed[variant] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                continue
            longest = max(longest, done[variant]["wall_s"])
        passes.append(done)
    if BF16 in failed:
        raise RuntimeError(f"the bf16 baseline failed, nothing to compare with: {failed[BF16]}")
    first = passes[0]
    window = sizes.loss_window
    bf16_loss = statistics.fmean(first[BF16]["losses"][-window:])
    out: dict[str, Any] = {"variants": variants, "passes": passes, "not_run_at_budget": not_run,
                           "bf16_tokens_per_s": statistics.median(p[BF16]["tokens_per_s"] for p in passes if BF16 in p),
                           "bf16_loss": bf16_loss, "recipes": {}}  # fmt: skip
    for recipe in recipes:
        if recipe in failed:
            out["recipes"][recipe] = {"error": failed[recipe]}
            continue
        paired = [p[recipe]["tokens_per_s"] / p[BF16]["tokens_per_s"] for p in passes if recipe in p and BF16 in p]
        loss = statistics.fmean(first[recipe]["losses"][-window:])
        loss_rel = abs(loss - bf16_loss) / abs(bf16_loss)
        speedup = statistics.median(paired)
        out["recipes"][recipe] = {
            "tokens_per_s": statistics.median(p[recipe]["tokens_per_s"] for p in passes if recipe in p),
            "speedup": speedup,
            "loss": loss,
            "loss_rel": loss_rel,
            "backend": first[recipe]["backend"],
            "fp8_linears": first[recipe]["fp8_linears"],
            "scaled_mm_refused": sorted({k for p in passes if recipe in p for k in p[recipe]["scaled_mm_refused"]}),
            "peak_allocated_bytes": first[recipe]["peak_allocated_bytes"],
            "met": {"speedup": speedup >= TARGET_SPEEDUP if recipe in TARGETED else None,
                    "loss": loss_rel <= TARGET_LOSS_REL},  # fmt: skip
        }
    return out


def skipped(recipes: tuple[str, ...]) -> list[str]:
    """The lines the report gives for recipes this part leaves out."""
    return [
        f"fp8 {r}: not timed (our backend emulates its tile/MX scales on this torch: dequantize + fp32 matmul, "
        f"slower than bf16 by construction); add it with --fp8-recipes to time it anyway"
        for r in EMULATED
        if r not in recipes
    ]


def markdown(r: dict[str, Any], sizes: Sizes, card: Card) -> list[str]:
    rows = [["bf16 mixed", f"{r['bf16_tokens_per_s']:,.0f}", "1.000", "", "", f"{r['bf16_loss']:.4f}", "", "",
             size(r["passes"][0][BF16]["peak_allocated_bytes"])]]  # fmt: skip
    for recipe, v in r["recipes"].items():
        if "error" in v:
            rows.append([f"fp8 {recipe}", f"failed: `{v['error']}`", *[""] * 7])
            continue
        emulated = f" (emulated: {len(v['scaled_mm_refused'])} refused)" if v["scaled_mm_refused"] else ""
        target = f"≥ {TARGET_SPEEDUP}" if recipe in TARGETED else "none set"
        rows.append([f"fp8 {recipe}, {v['backend']}{emulated}", f"{v['tokens_per_s']:,.0f}", f"{v['speedup']:.3f}",
                     target, verdict(v["met"]["speedup"]), f"{v['loss']:.4f}", pct(v["loss_rel"], 2),
                     verdict(v["met"]["loss"]), size(v["peak_allocated_bytes"])])  # fmt: skip
    lines = [
        f"Same model and data as part 1; one `Trainer(strategy=FiveDStrategy())` fit per run, each from the same "
        f"seed (same weights, same batches); {sizes.warmup} warm-up + {sizes.fp8_steps} timed steps; "
        f"{len(r['passes'])} passes over the variants, order rotating; speed-up = tokens/s over bf16's in the same pass, median. Loss: mean of the last "
        f"{sizes.loss_window} of {sizes.warmup + sizes.fp8_steps} steps, first pass; target within "
        f"{TARGET_LOSS_REL:.0%} of bf16.",
        "",
        *table(["run", "tokens/s", "speed-up", "target", "", "loss", "vs bf16", "", "peak memory"], rows),
    ]
    if r["not_run_at_budget"]:
        lines += ["", f"Not run (part's time budget): {', '.join(r['not_run_at_budget'])}."]
    refused = sorted({k for v in r["recipes"].values() for k in v.get("scaled_mm_refused", ())})
    if refused:
        lines += ["", "`torch._scaled_mm` refused (those GEMMs were emulated): " + "; ".join(f"`{k}`" for k in refused)]
    return lines
