"""Which ranks a torchmetrics ``Metric`` in the user's module syncs its states over.

torchmetrics sums (or gathers) a metric's states over the default process group, the whole
world, as if every rank had seen other data. Under tp the ranks of a tp group run the same
step on the same batch and update their metrics identically, so a sum over the world counts
each batch tp times (a ``SumMetric`` of top-32 hits: 28 for 14 under tp2). cp ranks hold
different shards of a sequence and pp's last stage alone reaches the step's end (the other
stages' states stay empty): both must be summed. So a metric syncs over every rank with its
own tp index (:meth:`ParallelMesh.across_tp_group`); without tp that is the world, unchanged.
A metric the user gave a ``process_group`` keeps it.
"""

from __future__ import annotations

from torch import nn
from torchmetrics import Metric

from lightning_5d.mesh import ParallelMesh


def metrics_of(module: nn.Module) -> list[Metric]:
    return [m for m in module.modules() if isinstance(m, Metric)]


def sync_metrics_across_tp(metrics: list[Metric], mesh: ParallelMesh) -> None:
    """Every one of ``metrics`` without a process group of its own syncs over ``across_tp_group``."""
    if mesh.layout.tp == 1:
        return
    unset = [m for m in metrics if m.process_group is None]
    if unset:  # the same on every rank (the same module): every rank creates the group
        group = mesh.across_tp_group()
        for metric in unset:
            metric.process_group = group
