"""Charts: per-rank memory breakdown, and predicted step time across planned layouts.

matplotlib is optional (``pip install 'lightning-5d[plot]'``) and imported only here, only when
a chart is asked for. Figures are drawn on matplotlib's object API, so no pyplot backend or
global state is touched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .estimator import Estimate
from .search import PlanEntry

PLOT_EXTRA = "pip install 'lightning-5d[plot]'"
_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
_COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974")


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plotting needs matplotlib, which is not installed; run: {PLOT_EXTRA}") from err
    return Figure(**kwargs)


def _memory_bars(
    ax, estimates: Sequence[Estimate], labels: Sequence[str], gpu_memory_gib: float | None
) -> None:
    left = [0.0] * len(estimates)
    rows = range(len(estimates))
    for part, color in zip(_PARTS, _COLORS, strict=True):
        widths = [est.memory.gib()[part] for est in estimates]
        ax.barh(rows, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    if gpu_memory_gib:
        ax.axvline(
            gpu_memory_gib, color="black", linestyle="--", linewidth=1, label=f"GPU {gpu_memory_gib:g} GiB"
        )
    ax.set_yticks(list(rows), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GiB on the most loaded rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never hides a bar


def plot_memory(
    estimates: Estimate | Sequence[Estimate],
    path: str | os.PathLike,
    labels: Sequence[str] | None = None,
    gpu_memory_gib: float | None = None,
) -> str:
    """Stacked bar per estimate: params / grads / optimizer / activations / buffers (GiB)."""
    estimates = [estimates] if isinstance(estimates, Estimate) else list(estimates)
    labels = list(labels) if labels else [est.setup.describe() for est in estimates]
    fig = _figure(figsize=(10, 1.8 + 0.5 * len(estimates)), layout="constrained")
    ax = fig.subplots()
    _memory_bars(ax, estimates, labels, gpu_memory_gib)
    ax.set_title(f"{estimates[0].spec.name}: per-rank memory")
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)


def plot_plan(
    entries: Sequence[PlanEntry], path: str | os.PathLike, gpu_memory_gib: float | None = None
) -> str:
    """Predicted step time (compute / bubble / exposed comm) and memory for each planned layout."""
    entries = list(entries)
    if not entries:
        raise ValueError("nothing to plot: the plan is empty.")
    labels = [f"#{e.rank} {e.setup.describe()}" for e in entries]
    fig = _figure(figsize=(13, 1.5 + 0.45 * len(entries)), layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2, sharey=True)
    rows = range(len(entries))
    parts = {
        "compute": [e.time.compute for e in entries],
        "bubble": [e.time.bubble for e in entries],
        "exposed comm": [e.time.total - e.time.compute - e.time.bubble for e in entries],
    }
    left = [0.0] * len(entries)
    for (name, widths), color in zip(parts.items(), _COLORS[:3], strict=True):
        ax_time.barh(rows, widths, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax_time.set_yticks(list(rows), labels, fontsize=7)  # the shared y axis is inverted once, in _memory_bars
    same_batch = len({e.estimate.flops.tokens_per_step for e in entries}) == 1
    ax_time.set_xlabel(
        "predicted step time (s)" + ("" if same_batch else " - global batch differs per layout")
    )
    ax_time.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.12 - 0.6 / len(entries)), ncol=3)
    _memory_bars(ax_mem, [e.estimate for e in entries], labels, gpu_memory_gib)
    fig.suptitle(f"{entries[0].estimate.spec.name} on {entries[0].setup.world_size} GPUs: ranked layouts")
    fig.savefig(os.fspath(path), dpi=120)
    return os.fspath(path)
