"""How far a parallel piece's output is from the unparallelized piece's, and when that is too far.

The measure is norm-wise: ``relative = ‖y_par − y_ref‖ / min(‖y_ref − x‖, ‖y_ref‖)`` for a
block whose output has its input's shape (``x`` is the block input), ``‖y_par − y_ref‖ / ‖y_ref‖``
otherwise. The denominator is the piece's own contribution: ``y_ref − x`` for a block that adds
its update to the residual stream, ``y_ref`` itself for a sub-layer of a container block that
returns only its update (the model's loop adds it); the smaller norm is that contribution in
both cases. At initialization a block adds a small update to a large residual; measured
against ``y_ref`` alone, even a block whose attention is completely wrong would look close.

Tolerances follow the dtype the parallel model computed in (both sides are compared in
float64 after the parallel output is upcast):

* fp32: ``1e-4``. A correct plan only re-associates sums (a tp all-reduce of partial
  matmuls, cp's online-softmax merge): about ``1e-6`` of the contribution on the reference
  model. A wrong layout (heads mixed, a fused projection cut in the wrong place, a lost
  scale) moves a piece's output by O(1) of its contribution.
* bf16 / fp16: ``5e-2`` / ``1e-2``: the parallel piece rounds every intermediate (unit
  roundoff 2^-8 / 2^-11) while the reference computes in fp32 from the same weights and
  inputs; those margins stay an order of magnitude below what a wrong layout gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def tolerance_for(dtype: torch.dtype) -> float:
    """The largest relative error a correct plan shows when the parallel model computes in ``dtype``."""
    return _TOLERANCE.get(dtype, _TOLERANCE[torch.bfloat16])


@dataclass(frozen=True)
class Difference:
    """One output's distance from the reference: the largest element-wise gap and the norm-wise ratio."""

    max_abs: float
    relative: float
    note: str = ""  # why the numbers are infinite (shapes differ, non-finite values)

    def exceeds(self, tolerance: float) -> bool:
        return not self.relative <= tolerance  # nan counts as exceeding

    def text(self) -> str:
        if self.note:
            return self.note
        return f"relative error {self.relative:.3g}, max abs error {self.max_abs:.3g}"


def difference(parallel: Tensor, reference: Tensor, residual_input: Tensor | None = None) -> Difference:
    """``parallel`` against ``reference`` (both full-shape); ``residual_input``: a block's input."""
    if tuple(parallel.shape) != tuple(reference.shape):
        shapes = f"shape {tuple(parallel.shape)} where the model gives {tuple(reference.shape)}"
        return Difference(math.inf, math.inf, shapes)
    p = parallel.detach().double()
    r = reference.detach().double().to(p.device)
    if not bool(torch.isfinite(p).all()):
        return Difference(math.inf, math.inf, "non-finite values where the model gives finite ones")
    gap = p - r
    denominator = float(r.norm())
    if residual_input is not None and tuple(residual_input.shape) == tuple(r.shape):
        update = float((r - residual_input.detach().double().to(r.device)).norm())
        if update > 0.0:  # 0: a piece that adds nothing, compared against its output instead
            denominator = min(denominator, update)
    max_abs = float(gap.abs().max()) if gap.numel() else 0.0
    if denominator == 0.0:
        return Difference(max_abs, 0.0 if max_abs == 0.0 else math.inf)
    return Difference(max_abs, float(gap.norm()) / denominator)


@dataclass(frozen=True)
class PieceResult:
    """The verdict on one piece (the embedding, one block, the final norm, the head).

    ``parts`` are the submodules compared inside it (projections, the attention and MLP
    modules), in the order the reference ran them, each with its difference.
    """

    name: str  # what it is: "block 3", "embedding", "head"
    path: str  # dotted module path from the LightningModule
    output: Difference
    tolerance: float
    parts: tuple[tuple[str, Difference], ...] = ()
    # Each parameter's gradient (full path) after one backward of the piece, against the
    # reference piece's; empty where gradients were not compared (verify="outputs").
    grads: tuple[tuple[str, Difference], ...] = ()
    # The gradients' own tolerance (None: ``tolerance``). A backward in bf16 rounds once more per
    # product it accumulates: a correct plan's weight gradients on the reference model under bf16
    # mixed were 0.050-0.055 off the fp32 reference (outputs 0.034), a wrong one (a skipped tp
    # sum, a wrong cut) 0.5 or more.
    grad_tolerance: float | None = None

    @property
    def gradient_tolerance(self) -> float:
        return self.tolerance if self.grad_tolerance is None else self.grad_tolerance

    @property
    def failed(self) -> bool:
        return self.output.exceeds(self.tolerance) or bool(self.failed_grads())

    def failed_parts(self) -> list[tuple[str, Difference]]:
        return [(path, d) for path, d in self.parts if d.exceeds(self.tolerance)]

    def failed_grads(self) -> list[tuple[str, Difference]]:
        return [(path, d) for path, d in self.grads if d.exceeds(self.gradient_tolerance)]

    def worst_relative(self) -> float:
        """The largest relative error of the output and every gradient (for the summary)."""
        return max([self.output.relative, *(d.relative for _, d in self.grads)])

    def describe(self) -> str:
        if not self.output.exceeds(self.tolerance):
            bad = self.failed_grads()
            lines = [f"{self.name} ({self.path}): the output matches ({self.output.text()}), but after one backward "
                     f"of the piece {len(bad)} of its {len(self.grads)} parameter gradients do not "
                     f"(tolerance {self.gradient_tolerance:g}):"]  # fmt: skip
            lines += [f"    gradient of {path}: {d.text()}" for path, d in bad]
            good = [path for path, d in self.grads if not d.exceeds(self.gradient_tolerance)]
            if good:
                lines.append(f"    matching gradients: {', '.join(good)}")
            return "\n".join(lines)
        lines = [f"{self.name} ({self.path}): {self.output.text()} (tolerance {self.tolerance:g})"]
        bad = self.failed_parts()
        if bad:
            first_path, first = bad[0]
            worst_path, worst = max(bad, key=lambda item: item[1].relative)
            lines.append(f"    first wrong output in execution order: {first_path}: {first.text()}")
            if worst_path != first_path:
                lines.append(f"    worst output: {worst_path}: {worst.text()}")
            good = [path for path, d in self.parts if not d.exceeds(self.tolerance)]
            if good:
                lines.append(f"    matching: {', '.join(good)}")
        return "\n".join(lines)


class PlanVerificationError(RuntimeError):
    """The parallel model computes something other than the model: setup stops before training."""


def mismatch_message(failed: list[PieceResult], layout: str) -> str:
    """The error text: each wrong piece with its numbers, then what the user can do."""
    body = "\n  ".join(r.describe() for r in failed)
    return (
        f"the parallelized model does not compute what the model computes ({layout}); setup stopped before "
        f"any training step. Compared piece by piece with the unparallelized pieces on a probe input:\n  {body}\n"
        f"A projection that matches while the module around it does not means the split is wrong for how the "
        f"module uses those columns (fused or interleaved q/k/v, a fused [gate|up], heads read from a config) "
        f"or the parallel version skips work the module does (an embedding that scales its output). A gradient "
        f"that differs while the output matches means a sum over ranks is missing or doubled (a replicated "
        f"parameter that sees only this rank's heads or sequence shard). Describe the "
        f"module with `model_plan` (docs/model_plans.md), use a layout without the dimension that splits it, or "
        f"pass FiveDStrategy(verify='off') (l5d train: parallel.verify=off) to train anyway on these numbers."
    )
