"""Losses and logged metrics under context parallelism: means over the whole sequence.

A cp rank sees only its shard's tokens, so a per-token mean it computes is a mean over
S/cp tokens, and padding (label −100) may fall unevenly on the shards. Inside a step:

* ``F.cross_entropy`` with ``reduction="mean"`` becomes Σ_ranks(local sum) / Σ_ranks(count):
  the token-weighted mean over the whole sequence, bit-identical on every cp rank
  (``"sum"`` becomes the sum over the sequence);
* a float handed to ``self.log`` / ``self.log_dict`` is combined over the cp ranks by the
  call's ``reduce_fx``, as Lightning combines data ranks under ``sync_dist``: the mean
  weighted by the tokens each rank's labels cover (the default), or the sum, max or min,
  again identical on every rank. That is one collective per call: every cp rank must log the
  same names in the same order (values logged with ``rank_zero_only=True`` are left alone).

Gradients: the cp ranks hold disjoint parts of the same sequences, so the loss gradient is
the *sum* of their contributions, while the data-parallel engine *averages* over dp×cp
(dividing by cp as well). :class:`_SumOverContext` scales the backward by cp so that the
average comes out as that sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.parallel.context.state import ContextState
from lightning_5d.parallel.step_log import reduce_fx_name

CROSS_ENTROPY_ARGS = (
    "input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing",
)  # fmt: skip


class _SumOverContext(torch.autograd.Function):
    """Forward: the sum over the cp group. Backward: the incoming gradient times cp (see module doc)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any, size: int) -> Tensor:  # type: ignore[override]
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        ctx.size = size
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.size, None, None


def _counted_targets(bound: dict) -> Tensor:
    """What ``reduction="mean"`` divides by: non-ignored (weighted) targets, or rows for probability targets."""
    logits, target = bound["input"], bound["target"]
    if target.is_floating_point():
        rows = logits.numel() // logits.size(1) if logits.dim() >= 2 else 1
        return torch.tensor(float(rows), dtype=torch.float64, device=target.device)
    valid = target != bound.get("ignore_index", -100)
    weight = bound.get("weight")
    if weight is None:
        return valid.sum().to(torch.float64)
    return weight[target[valid]].sum().to(torch.float64)


def global_cross_entropy(cp: ContextState, func: Any, args: tuple, kwargs: dict) -> Any:
    bound = {**dict(zip(CROSS_ENTROPY_ARGS, args)), **kwargs}
    reduction = bound.get("reduction", "mean")
    if bound.get("size_average") is not None or bound.get("reduce") is not None or reduction == "none":
        return func(*args, **kwargs)  # legacy flags or per-token output: the caller reduces
    local_sum = func(**{**bound, "reduction": "sum"})
    total = _SumOverContext.apply(local_sum, cp.group, cp.size)
    if reduction == "sum":
        return cp.mark_global(total)
    count = _counted_targets(bound)
    dist.all_reduce(count, group=cp.group)
    # Divide in fp32 at least: a bf16 count above 256 would already be rounded.
    wide = torch.promote_types(total.dtype, torch.float32)
    return cp.mark_global((total.to(wide) / count.to(wide)).to(total.dtype))


_SHARD_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def global_metric(cp: ContextState, value: Any, reduce_fx: Any = "mean") -> Any:
    """A logged float over the whole sequence: its shards' values combined by the log call's
    ``reduce_fx``, as Lightning combines data ranks' values under ``sync_dist``. The mean is
    weighted by the tokens each rank's labels cover; sum, max and min are over the cp ranks.
    Other values are unchanged.

    Under tp a value derived from the vocabulary-sharded logits arrives here as a plain tensor
    already (tensor/plain.py: tp's log is the innermost of the step's)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point() or cp.is_global(value):
            return value
        # The collective runs on the group's device (a CPU value would not reach NCCL).
        device = cp.current_shard.positions.device
        value = value.to(device)
        op = _SHARD_OPS.get(reduce_fx_name(reduce_fx))
        if op is not None:
            combined = value.detach().to(torch.float64, copy=True).reshape(())  # the user's value stays
            dist.all_reduce(combined, op=op, group=cp.group)
            return combined.to(value.dtype).reshape(value.shape)
        weight = cp.current_shard.token_weight().to(device)
        both = torch.stack([value.detach().to(torch.float64).reshape(()) * weight, weight])
        dist.all_reduce(both, group=cp.group)
        return (both[0] / both[1]).to(value.dtype).reshape(value.shape)
    if isinstance(value, float):
        device = cp.current_shard.positions.device
        return float(global_metric(cp, torch.tensor(value, dtype=torch.float64, device=device), reduce_fx))
    return value
