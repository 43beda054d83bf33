"""Charts: per-rank memory against the GPU, and where ranked layouts lose time.

matplotlib is optional (``pip install 'lightning-5d[plot]'``) and imported only here, only when
a chart is asked for. Figures are drawn on matplotlib's object API, so no pyplot backend or
global state is touched. What is drawn comes from ``chart_data.py``.

Colours: memory parts and time parts use separate palettes (no colour means two things), and
red is kept for one meaning only: more memory than the GPU has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .chart_data import (
    MEMORY_PARTS,
    TIME_PARTS,
    Limits,
    MemoryRow,
    MemoryVerdict,
    TimeRow,
    memory_rows,
    memory_warning,
    time_rows,
)
from .estimator import Estimate
from .search import PlanEntry

PLOT_EXTRA = "pip install 'lightning-5d[plot]'"
MEMORY_COLORS = dict(zip(MEMORY_PARTS, ("#4C72B0", "#8FB8DE", "#8172B2", "#55A868", "#CCB974"), strict=True))
TIME_COLORS = dict(zip(TIME_PARTS, ("#9E9E9E", "#DD8452", "#937860"), strict=True))
OVER = "#D62728"  # over the GPU's capacity, and nothing else
TIGHT = "#E69F00"  # over the usable memory, under the capacity
_LABEL_BOX = dict(facecolor="white", edgecolor="none", pad=0.5)  # labels stay legible over the limit lines
_LEGEND = dict(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, borderaxespad=0.2)


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plotting needs matplotlib, which is not installed; run: {PLOT_EXTRA}") from err
    return Figure(**kwargs)


def _stacked(ax, rows: range, parts: dict[str, list[float]], colors: dict[str, str]) -> list[float]:
    left = [0.0] * len(rows)
    for name, widths in parts.items():
        ax.barh(rows, widths, left=left, color=colors[name], label=name, height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    return left


def _memory_bars(ax, rows: Sequence[MemoryRow], limits: Limits) -> None:
    index = range(len(rows))
    ends = _stacked(ax, index, {p: [r.parts_gib[p] for r in rows] for p in MEMORY_PARTS}, MEMORY_COLORS)
    right = max([*ends, limits.capacity_gib or 0.0]) * 1.32  # room for the labels after the bars
    if limits.capacity_gib:
        ax.axvspan(limits.capacity_gib, right, color=OVER, alpha=0.08, linewidth=0)
        ax.axvline(limits.capacity_gib, color=OVER, linewidth=1.5, label=f"GPU capacity {limits.capacity_gib:g} GiB")
        ax.axvline(
            limits.usable_gib, color="black", linestyle="--", linewidth=1, label=f"usable {limits.usable_gib:.1f} GiB"
        )
    for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
        color = {MemoryVerdict.OVER_CAPACITY: OVER, MemoryVerdict.OVER_USABLE: TIGHT}.get(row.verdict, "black")
        if row.verdict != MemoryVerdict.FITS:
            ax.barh([i], [end], color="none", edgecolor=color, linewidth=2, height=0.7)
        ax.text(end + right * 0.01, i, row.warning or f"{end:.1f}", va="center", fontsize=7, color=color,
                fontweight="bold" if row.warning else "normal", bbox=_LABEL_BOX)  # fmt: skip
    ax.set_xlim(0, right)
    ax.set_yticks(list(index), [r.label for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_xlabel("GiB on the most loaded rank")
    ax.legend(ncol=4, **_LEGEND)


def _time_bars(ax, rows: Sequence[TimeRow]) -> None:
    index = range(len(rows))
    longest = max(sum(r.parts_s.values()) for r in rows)
    unit, scale = ("ms", 1e3) if longest < 1 else ("s", 1.0)
    parts = {p: [r.parts_s[p] * scale for r in rows] for p in TIME_PARTS}
    ends = _stacked(ax, index, parts, TIME_COLORS)
    right = max(max(ends), 1e-9) * 1.45
    for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
        label = f"step {row.total_s:#.4g} s, MFU {100 * row.mfu:.1f}%"
        ax.text(end + right * 0.01, i, label, va="center", fontsize=7, bbox=_LABEL_BOX)
    ax.set_xlim(0, right)
    ax.set_yticks(list(index), [r.label for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"{unit} per step beyond the ideal compute (model FLOPs at the assumed efficiency)")
    ax.legend(ncol=3, **_LEGEND)


def _title(fig, title: str, subtitle: str, warning: str) -> None:
    lines = [title] + [s for s in (subtitle,) if s]
    fig.suptitle("\n".join(lines), fontsize=10)
    if warning:  # supxlabel: the constrained layout makes room for it under the axes
        fig.supxlabel(warning, color=OVER, fontsize=9, fontweight="bold")


def plot_memory(
    estimates: Estimate | Sequence[Estimate],
    path: str | os.PathLike,
    labels: Sequence[str] | None = None,
    gpu_memory_gib: float | None = None,
    memory_headroom: float = 0.1,
) -> str:
    """Stacked bar per estimate (params / grads / optimizer / activations / buffers, GiB) against the GPU."""
    estimates = [estimates] if isinstance(estimates, Estimate) else list(estimates)
    labels = list(labels) if labels else [est.setup.describe() for est in estimates]
    limits = Limits.of(gpu_memory_gib, memory_headroom)
    rows = memory_rows(estimates, labels, limits)
    warning = memory_warning(rows, limits)
    fig = _figure(figsize=(10, 2.2 + 0.5 * len(rows) + (0.3 if warning else 0)), layout="constrained")
    _memory_bars(fig.subplots(), rows, limits)
    _title(fig, f"{estimates[0].spec.name}: per-rank memory", "", warning)
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)


def plot_plan(
    entries: Sequence[PlanEntry],
    path: str | os.PathLike,
    gpu_memory_gib: float | None = None,
    memory_headroom: float = 0.1,
) -> str:
    """Where each ranked layout loses time (left) and its memory against the GPU (right)."""
    entries = list(entries)
    if not entries:
        raise ValueError("nothing to plot: the plan is empty.")
    labels = [f"#{e.rank} {e.setup.describe()}" for e in entries]
    limits = Limits.of(gpu_memory_gib, memory_headroom)
    mem = memory_rows([e.estimate for e in entries], labels, limits)
    warning = memory_warning(mem, limits)
    fig = _figure(figsize=(15, 2.4 + 0.42 * len(entries) + (0.3 if warning else 0)), layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2)
    _time_bars(ax_time, time_rows(entries, labels))
    _memory_bars(ax_mem, mem, limits)
    ax_mem.set_yticks(list(range(len(entries))), [f"#{e.rank}" for e in entries], fontsize=7)
    ax_time.get_yticklabels()[0].set_fontweight("bold")
    same_batch = len({e.estimate.flops.tokens_per_step for e in entries}) == 1
    why = f"#1 beats #2 on {entries[0].ahead_because}" if len(entries) > 1 and entries[0].ahead_because else ""
    if not same_batch:
        why += " (global batch differs per layout)"
    title = f"{entries[0].estimate.spec.name} on {entries[0].setup.world_size} GPUs: ranked layouts"
    _title(fig, title, why, warning)
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)
