"""Logged metrics under context parallelism: means over the whole sequence.

A cp rank sees only its shard's tokens, so a per-token mean it computes is a mean over
S/cp tokens, and padding (label −100) may fall unevenly on the shards. Inside a step
``F.cross_entropy`` is the token mean over the whole batch (``parallel/token_mean.py``), and

* a float handed to ``self.log`` / ``self.log_dict`` is combined over the cp ranks by the
  call's ``reduce_fx``, as Lightning combines data ranks under ``sync_dist``: the mean
  weighted by the tokens each rank's labels cover (the default), or the sum, max or min,
  again identical on every rank. That is one collective per call: every cp rank must log the
  same names in the same order (values logged with ``rank_zero_only=True`` are left alone).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.parallel.context.state import ContextState
from lightning_5d.parallel.step_log import reduce_fx_name

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
