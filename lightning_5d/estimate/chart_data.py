"""What the planner's charts show, as plain data (``plot.py`` draws it; tests check it without pixels).

Memory rows carry a verdict against the GPU: fits in the usable memory (the GPU less the
headroom kept for the CUDA context, NCCL buffers and fragmentation), over the usable memory but
under the GPU's capacity, or over the capacity. Time rows carry what a step spends beyond its
ideal compute (model FLOPs at the assumed efficiency): recomputation, bubble and exposed
communication, which is where ranked layouts differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .estimator import Estimate
from .search import PlanEntry
from .timing import GIB

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_PARTS = ("recompute", "bubble", "exposed comm")


class MemoryVerdict(str, Enum):
    FITS = "fits"
    OVER_USABLE = "over_usable"  # under the GPU's capacity, but eats the headroom
    OVER_CAPACITY = "over_capacity"  # cannot run


@dataclass(frozen=True)
class MemoryRow:
    label: str
    parts_gib: dict[str, float]  # MEMORY_PARTS, in order
    total_gib: float
    verdict: MemoryVerdict

    @property
    def warning(self) -> str:
        if self.verdict == MemoryVerdict.OVER_CAPACITY:
            return f"{self.total_gib:.1f} GiB: does NOT fit"
        if self.verdict == MemoryVerdict.OVER_USABLE:
            return f"{self.total_gib:.1f} GiB: over the usable memory"
        return ""


@dataclass(frozen=True)
class Limits:
    """The GPU's capacity and the part of it a layout may use (GiB); None when unknown."""

    capacity_gib: float | None
    usable_gib: float | None

    @classmethod
    def of(cls, gpu_memory_gib: float | None, memory_headroom: float) -> Limits:
        if not gpu_memory_gib:
            return cls(None, None)
        return cls(gpu_memory_gib, gpu_memory_gib * (1 - memory_headroom))

    def verdict(self, total_gib: float) -> MemoryVerdict:
        if self.capacity_gib is not None and total_gib > self.capacity_gib:
            return MemoryVerdict.OVER_CAPACITY
        if self.usable_gib is not None and total_gib > self.usable_gib:
            return MemoryVerdict.OVER_USABLE
        return MemoryVerdict.FITS


def memory_rows(estimates: Sequence[Estimate], labels: Sequence[str], limits: Limits) -> list[MemoryRow]:
    rows = []
    for est, label in zip(estimates, labels, strict=True):
        gib = est.memory.gib()
        total = est.memory.total / GIB
        rows.append(MemoryRow(label, {p: gib[p] for p in MEMORY_PARTS}, total, limits.verdict(total)))
    return rows


def memory_warning(rows: Sequence[MemoryRow], limits: Limits) -> str:
    """One sentence for the chart's top when a row does not fit; "" when all do."""
    over = [r for r in rows if r.verdict == MemoryVerdict.OVER_CAPACITY]
    tight = [r for r in rows if r.verdict == MemoryVerdict.OVER_USABLE]
    if over:
        worst = max(r.total_gib for r in over)
        what = "this layout needs" if len(rows) == 1 else f"{len(over)} of {len(rows)} layouts need"
        return f"WARNING: {what} up to {worst:.1f} GiB per GPU, more than the GPU's {limits.capacity_gib:g} GiB"
    if tight:
        what = "this layout uses" if len(rows) == 1 else f"{len(tight)} of {len(rows)} layouts use"
        return (
            f"WARNING: {what} more than the usable {limits.usable_gib:.1f} GiB "
            f"(the GPU's {limits.capacity_gib:g} GiB less headroom)"
        )
    return ""


@dataclass(frozen=True)
class TimeRow:
    label: str
    parts_s: dict[str, float]  # TIME_PARTS, in order: seconds beyond the ideal compute
    ideal_s: float  # model FLOPs at the assumed efficiency, bubble- and communication-free
    total_s: float
    mfu: float


def time_rows(entries: Sequence[PlanEntry], labels: Sequence[str]) -> list[TimeRow]:
    rows = []
    for e, label in zip(entries, labels, strict=True):
        t, flops = e.time, e.estimate.flops
        ideal = t.compute * flops.model_per_step / flops.hardware_per_step
        parts = {
            "recompute": t.compute - ideal,
            "bubble": t.bubble,
            # Exposed traffic, and any wait for the busiest link beyond it.
            "exposed comm": t.total - t.compute - t.bubble,
        }
        rows.append(TimeRow(label, parts, ideal, t.total, t.predicted_mfu))
    return rows
