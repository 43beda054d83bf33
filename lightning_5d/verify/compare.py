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


# Elements per step of the float64 comparison: 2 MiB of each temporary, whatever the tensor's size
# (a 32000 x 2048 weight gradient compared whole in float64 held four 500 MiB temporaries; at 8 MiB
# a step the temporaries, below glibc's mmap threshold, stayed resident: +61 MiB at the head's
# gradient check of a 74 M model under tp2, +22 MiB now; benchmarks/RESULTS.md "stop 35").
_CHUNK = 1 << 18


def row_blocks(t: Tensor) -> list[Tensor]:
    """``t`` as consecutive blocks of its leading dim (views), each about ``_CHUNK`` elements."""
    if t.dim() == 0:
        return [t.reshape(1)]
    per_row = max(1, t[0].numel())
    rows = max(1, _CHUNK // per_row)
    return [t.narrow(0, i, min(rows, t.size(0) - i)) for i in range(0, t.size(0), rows)]


@dataclass
class GapSums:
    """The sums a :class:`Difference` is made of, accumulated over pieces of a tensor in float64:
    ``Σ(p − r)²``, ``Σr²``, ``Σ(r − x)²`` (a block's update), ``max |p − r|`` and whether ``p``
    had a non-finite value. Sums over disjoint pieces add up to the whole tensor's, so a tensor
    cut over ranks (a tp shard against the matching slice of the reference) is measured by
    adding every rank's sums (:meth:`as_tensors` / :meth:`from_tensors` for the all-reduce)."""

    gap_sq: float = 0.0
    reference_sq: float = 0.0
    update_sq: float = 0.0
    max_abs: float = 0.0
    non_finite: bool = False

    def add(self, parallel: Tensor, reference: Tensor, residual_input: Tensor | None = None) -> "GapSums":
        """Accumulate ``parallel`` against ``reference`` (same shape), block by block of rows."""
        p_blocks = row_blocks(parallel.detach())
        r_blocks = row_blocks(reference.detach())
        x_blocks = row_blocks(residual_input.detach()) if residual_input is not None else [None] * len(r_blocks)
        for p, r, x in zip(p_blocks, r_blocks, x_blocks):
            self.add_block(p, r, x)
        return self

    def add_block(self, parallel: Tensor, reference: Tensor, residual_input: Tensor | None = None) -> "GapSums":
        """Accumulate one block (same shape on both sides); ``reference`` may live on another device
        (a block read back from a spill: :mod:`.shard_compare`)."""
        p64 = parallel.detach().double()
        if not bool(torch.isfinite(p64).all()):
            self.non_finite = True
            return self
        r64 = reference.detach().double().to(p64.device)
        if residual_input is not None:
            self.update_sq += float((r64 - residual_input.detach().double().to(p64.device)).square().sum())
        self.reference_sq += float(r64.square().sum())
        gap = p64 - r64  # not in place: for a float64 piece .double() is the recorded tensor itself
        if gap.numel():
            self.max_abs = max(self.max_abs, float(gap.abs().max()))
        self.gap_sq += float(gap.square().sum())
        return self

    def result(self, use_update: bool = False) -> Difference:
        """The :class:`Difference` of the accumulated pieces; ``use_update``: the denominator is the
        smaller of ``‖r‖`` and ``‖r − x‖`` (a block's own contribution; see the module docstring)."""
        if self.non_finite:
            return Difference(math.inf, math.inf, "non-finite values where the model gives finite ones")
        denominator = math.sqrt(self.reference_sq)
        if use_update and self.update_sq > 0.0:  # 0: a piece that adds nothing, compared against its output
            denominator = min(denominator, math.sqrt(self.update_sq))
        if denominator == 0.0:
            return Difference(self.max_abs, 0.0 if self.max_abs == 0.0 else math.inf)
        return Difference(self.max_abs, math.sqrt(self.gap_sq) / denominator)


def difference(parallel: Tensor, reference: Tensor, residual_input: Tensor | None = None) -> Difference:
    """``parallel`` against ``reference`` (both full-shape); ``residual_input``: a block's input.

    Computed in float64 a block of rows at a time (:class:`GapSums`): the extra memory is a
    few 2 MiB blocks whatever the size of the tensors."""
    if tuple(parallel.shape) != tuple(reference.shape):
        shapes = f"shape {tuple(parallel.shape)} where the model gives {tuple(reference.shape)}"
        return Difference(math.inf, math.inf, shapes)
    residual = None
    if residual_input is not None and tuple(residual_input.shape) == tuple(reference.shape):
        residual = residual_input
    return GapSums().add(parallel, reference, residual).result(use_update=residual is not None)


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
