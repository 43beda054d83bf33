"""One global gradient norm over every way a parameter can be split.

A gradient on this rank is one of: the whole gradient (replicated), a slice over the data
ranks (a ``DTensor``: ZeRO-1/2 master slices, FSDP2 shards), a TP shard (a plain tensor
holding 1/tp of the parameter), or both. ``DTensor`` norms already sum over the data
ranks; TP shards add their p-th powers over the TP group, routed experts (each ep rank
holds different ones) over the ep group, and replicated gradients are counted once. The
result is the norm one process would compute on the full model.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def _norm_of(grads: list[Tensor], norm_type: float, dtype: torch.dtype) -> Tensor:
    """The norm over ``grads`` (dense tensors and/or DTensors), as a plain scalar."""
    parts = []
    for wanted in (DTensor, Tensor):
        group = [g for g in grads if isinstance(g, DTensor) == (wanted is DTensor)]
        if group:
            n = torch.nn.utils.get_total_norm(group, norm_type)
            parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not parts:
        return torch.zeros((), dtype=dtype)
    stacked = torch.stack([p.to(parts[0].device) for p in parts])
    return stacked.max() if math.isinf(norm_type) else stacked.norm(norm_type)


def total_grad_norm(
    parameters: Iterable[Tensor],
    is_tp_sharded: Callable[[Tensor], bool],
    tp_group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
    is_expert: Callable[[Tensor], bool] | None = None,
    expert_group: dist.ProcessGroup | None = None,
    counted_elsewhere: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """``stage_group``: ranks holding disjoint parameters (pipeline stages), whose parts add up;
    ``expert_group``: the ep ranks, whose ``is_expert`` parameters are disjoint too;
    ``counted_elsewhere``: copies another stage counts (a tied embedding on the last stage)."""
    elsewhere = counted_elsewhere or (lambda p: False)
    params = [p for p in parameters if p.grad is not None and not elsewhere(p)]
    is_expert = is_expert or (lambda p: False)
    sharded = [p.grad for p in params if is_tp_sharded(p)]
    routed = [p.grad for p in params if is_expert(p) and not is_tp_sharded(p)]
    replicated = [p.grad for p in params if not is_tp_sharded(p) and not is_expert(p)]
    dtype = params[0].grad.dtype if params else torch.float32
    tp_part = _norm_of(sharded, norm_type, dtype)
    rep_part = _norm_of(replicated, norm_type, dtype).to(tp_part.device)
    ep_part = _norm_of(routed, norm_type, dtype).to(tp_part.device)
    if math.isinf(norm_type):
        if tp_group is not None:
            dist.all_reduce(tp_part, op=dist.ReduceOp.MAX, group=tp_group)
        if expert_group is not None:
            dist.all_reduce(ep_part, op=dist.ReduceOp.MAX, group=expert_group)
        total = torch.maximum(torch.maximum(tp_part, rep_part), ep_part)
        if stage_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=stage_group)
        return total
    powered = tp_part.double() ** norm_type
    if tp_group is not None:
        dist.all_reduce(powered, group=tp_group)
    ep_powered = ep_part.double() ** norm_type
    if expert_group is not None:
        dist.all_reduce(ep_powered, group=expert_group)
    powered = powered + rep_part.double() ** norm_type + ep_powered
    if stage_group is not None:
        dist.all_reduce(powered, group=stage_group)
    return (powered ** (1.0 / norm_type)).to(tp_part.dtype)


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    is_tp_sharded: Callable[[Tensor], bool],
    tp_group: dist.ProcessGroup | None,
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
    is_expert: Callable[[Tensor], bool] | None = None,
    expert_group: dist.ProcessGroup | None = None,
    counted_elsewhere: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the global norm of :func:`total_grad_norm`; every
    parameter is scaled, ``counted_elsewhere`` ones (still) without entering the norm here."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(
        params, is_tp_sharded, tp_group, norm_type, stage_group, is_expert, expert_group, counted_elsewhere
    )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.device, g.dtype))
    return total
