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


_SHARD_COMBINE = {"sum": torch.sum, "max": torch.max, "min": torch.min}


def global_metric(cp: ContextState, value: Any, reduce_fx: Any = "mean", name: str = "") -> Any:
    """A logged number over the whole sequence: its shards' values combined by the log call's
    ``reduce_fx``, as Lightning combines data ranks' values under ``sync_dist``. A mean is
    weighted by the tokens each rank's labels cover; a sum, max or min is over the cp ranks.

    Scalar tensors and Python floats are combined: an integer tensor is a count of the shard's
    tokens, summed under the default mean too. Python ints are left as they are (a batch size:
    the same on every shard), and so is anything else. A float count logged with the default
    mean cannot be told from a mean and is averaged (docs/context_parallel.md). Bools stay. Under
    tp a value derived from the vocabulary-sharded logits arrives here as a plain tensor
    already (tensor/plain.py: tp's log is the innermost of the step's)."""
    if isinstance(value, float):
        device = cp.current_shard.positions.device
        return float(global_metric(cp, torch.tensor(value, dtype=torch.float64, device=device), reduce_fx, name))
    if not isinstance(value, Tensor) or value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
        return value
    if cp.is_global(value):
        return value
    # The collective runs on the group's device (a CPU value would not reach NCCL).
    device = cp.current_shard.positions.device
    value = value.to(device)
    wide = value.detach().to(torch.float64, copy=True).reshape(())  # the user's tensor stays as it is
    fx = reduce_fx_name(reduce_fx)
    if fx == "mean" and not value.is_floating_point():
        fx = "sum"  # an integer is a count of the shard's tokens: the sequence's is the shards' sum
    combine = _SHARD_COMBINE.get(fx)
    if combine is not None:
        shards = [torch.empty_like(wide) for _ in range(cp.size)]
        dist.all_gather(shards, wide, group=cp.group)
        values = torch.stack(shards)
        if combine is torch.sum and bool((values == values[0]).all()) and values[0] != 0:
            cp.warn_same_on_every_shard(name, float(values[0]))
        out = combine(values)
    else:
        weight = cp.current_shard.token_weight().to(device)
        both = torch.stack([wide * weight, weight])
        dist.all_reduce(both, group=cp.group)
        out = both[0] / both[1]
    return out.to(value.dtype).reshape(value.shape)
