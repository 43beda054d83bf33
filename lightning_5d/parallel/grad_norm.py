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

from lightning_5d.parallel.regions import local_tensor


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
        g = local_tensor(p.grad)
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _shard_groups(t: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """The groups over which a DTensor's pieces are disjoint (its mesh dims with a Shard placement)."""
    return tuple(t.device_mesh.get_group(d) for d, p in enumerate(t.placements) if p.is_shard())


def per_parameter_norms(
    pieces: dict[str, Tensor],
    names: list[str],
    norm_type: float,
    *,
    device: torch.device | None = None,
    tp_group: dist.ProcessGroup | None = None,
    tp_sharded: Callable[[str], bool] = lambda name: False,
    expert_group: dist.ProcessGroup | None = None,
    is_expert: Callable[[str], bool] = lambda name: False,
    stage_group: dist.ProcessGroup | None = None,
) -> dict[str, Tensor]:
    """Each parameter's whole-gradient norm (float64) from this rank's pieces of the gradients;
    the same on every rank.

    ``pieces``: name -> this rank's piece of that gradient (a plain tensor; a DTensor whose pieces
    are disjoint over its Shard mesh dims); ``names``: every rank's names, in one order on every
    rank (other pp stages' and other ep ranks' parameters included). A piece is disjoint from its
    peers' over the DTensor's shard groups, the tp group for ``tp_sharded`` names, the ep group
    for ``is_expert`` ones (each ep rank holds other experts, or other rows of them) and the stage
    group (names another stage holds are zero here). One vector
    of p-th powers (maxima for the inf-norm) is summed over each group in a fixed order, so
    every rank issues the same collectives whatever it holds: O(#parameters) numbers per group.
    """
    index = {n: i for i, n in enumerate(names)}
    infinite = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    # Every rank's vectors on the collective's device, also a rank holding no gradient (NCCL).
    device = device or next((p.device for p in pieces.values()), torch.device("cpu"))
    powered = torch.zeros(len(names), dtype=torch.float64, device=device)
    present = torch.zeros(len(names), dtype=torch.float64, device=device)
    by_groups: dict[tuple, list[int]] = {}
    for name, piece in pieces.items():
        i = index[name]
        local = local_tensor(piece)
        # A rank may hold an empty piece (ZeRO's padding chunk): it adds nothing.
        n = torch.linalg.vector_norm(local.detach().double(), norm_type) if local.numel() else powered.new_zeros(())
        powered[i] = n if infinite else n**norm_type
        present[i] = 1.0
        if isinstance(piece, DTensor):
            by_groups.setdefault(_shard_groups(piece), []).append(i)

    def over(group: dist.ProcessGroup | None, rows: list[int]) -> None:
        if group is None or dist.get_world_size(group) == 1:
            return
        part = torch.zeros_like(powered)
        part[rows] = powered[rows]
        dist.all_reduce(part, op=op, group=group)
        powered[rows] = part[rows]

    # Every rank of a DTensor's shard group holds the same names (same stage, tp and ep rank): the
    # groups' order is the same on all of them.
    for groups in sorted(by_groups, key=lambda gs: tuple(dist.get_process_group_ranks(g) for g in gs)):
        for g in groups:
            over(g, by_groups[groups])
    # Rows of every rank's names: an ep peer's experts are rows this rank holds as zeros.
    over(tp_group, [i for i, n in enumerate(names) if tp_sharded(n)])
    over(expert_group, [i for i, n in enumerate(names) if is_expert(n)])
    if stage_group is not None:
        dist.all_reduce(powered, op=op, group=stage_group)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=stage_group)
    if expert_group is not None:  # names held by other ep ranks only (a dropped expert module)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=expert_group)
    norms = powered if infinite else powered ** (1.0 / norm_type)
    return {n: norms[index[n]] for n in names if present[index[n]] > 0}


def norm_of_norms(norms: Iterable[Tensor], norm_type: float) -> Tensor:
    """The norm of all the gradients together, from each one's norm (the norm of their norms)."""
    stacked = torch.stack(list(norms))
    return stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
