"""MoE token dispatch and combine: permute by expert, all-to-all, run local experts, back.

Symbols: T tokens on this rank, k experts per token, E experts in all, ep ranks in the
expert group, each owning E/ep consecutive experts (rank r owns r*E/ep ... (r+1)*E/ep-1).
One (token, slot) pair is an *assignment*; dropless routing sends all T*k of them.

Math and communication are kept apart: ``plan_dispatch`` decides who sends what (pure
tensor code), ``exchange`` moves rows (the only collectives), ``run_grouped`` hands each
local expert its contiguous rows. The all-to-all is its own autograd function, so the
gradient of every expert output flows back to the rank that sent the token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.config import DropPolicy


@dataclass
class DispatchPlan:
    """Who sends which assignment where, for one MoE call on this rank."""

    order: Tensor  # [N] indices into the flattened [T*k] assignments, sorted by expert
    tokens: Tensor  # [N] token of each sorted assignment
    weights: Tensor  # [N] router weight of each sorted assignment
    tokens_per_expert: Tensor  # [E] assignments routed to each expert, before dropping
    kept_per_expert: Tensor  # [E] assignments kept (equal to the above when dropless)
    send_splits: list[int]  # [ep] rows sent to each rank of the expert group
    recv_splits: list[int]  # [ep] rows received from each rank
    recv_per_expert: list[list[int]]  # [ep][E/ep] rows from source s for local expert j

    @property
    def dropped(self) -> int:
        return int((self.tokens_per_expert - self.kept_per_expert).sum())


def capacity(num_assignments: int, num_experts: int, factor: float) -> int:
    """Slots per expert: factor x the even share of this rank's assignments (GShard)."""
    return max(1, math.ceil(factor * num_assignments / num_experts))


def _keep_mask(experts: Tensor, weights: Tensor, num_experts: int, cap: int, policy: DropPolicy) -> Tensor:
    # Rank assignments inside each expert by the policy's key; keep the first `cap`.
    key = -weights if policy == DropPolicy.PROBABILITY else torch.arange(len(experts), device=experts.device).float()
    by_key = torch.argsort(key, stable=True)
    by_expert = by_key[torch.argsort(experts[by_key], stable=True)]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(experts)
    position[by_expert] = torch.arange(len(experts), device=experts.device) - starts[experts[by_expert]]
    return position < cap


def plan_dispatch(
    top_experts: Tensor,
    top_weights: Tensor,
    num_experts: int,
    ep: int,
    recv_counts: Callable[[Tensor], Tensor],
    capacity_factor: float | None = None,
    drop_policy: DropPolicy = DropPolicy.PROBABILITY,
) -> DispatchPlan:
    """Sort this rank's assignments by expert and size every all-to-all chunk.

    ``recv_counts`` exchanges the per-expert counts ([ep, E/ep], row r for rank r) and
    returns what each source rank sends to this rank's experts, same shape.
    """
    tokens_count, k = top_experts.shape
    experts = top_experts.reshape(-1)
    weights = top_weights.reshape(-1)
    tokens = torch.arange(tokens_count, device=experts.device).repeat_interleave(k)
    tokens_per_expert = torch.bincount(experts, minlength=num_experts)
    if capacity_factor is not None:
        keep = _keep_mask(
            experts, weights, num_experts, capacity(len(experts), num_experts, capacity_factor), drop_policy
        )
        kept_index = keep.nonzero().squeeze(1)
    else:
        kept_index = torch.arange(len(experts), device=experts.device)
    order = kept_index[torch.argsort(experts[kept_index], stable=True)]
    kept_per_expert = torch.bincount(experts[order], minlength=num_experts)
    local = num_experts // ep
    send = kept_per_expert.view(ep, local)
    received = recv_counts(send)
    return DispatchPlan(
        order=order,
        tokens=tokens[order],
        weights=weights[order],
        tokens_per_expert=tokens_per_expert,
        kept_per_expert=kept_per_expert,
        send_splits=send.sum(1).tolist(),
        recv_splits=received.sum(1).tolist(),
        recv_per_expert=received.tolist(),
    )


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send``, rows in by ``recv``; backward sends the gradients home."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


def exchange(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    if group is None:  # ep = 1: every expert is local
        return x
    return _AllToAll.apply(x, send, recv, group)


def exchange_counts(send: Tensor, group) -> Tensor:
    """[ep, E/ep] counts this rank sends -> [ep, E/ep] counts it receives (no autograd)."""
    if group is None:
        return send
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send.contiguous(), group=group)
    return out


def _source_major_to_expert_major(recv_per_expert: Sequence[Sequence[int]]) -> Tensor:
    # Received rows arrive grouped by source rank, then expert; experts want their rows together.
    sources, local = len(recv_per_expert), len(recv_per_expert[0])
    starts, offset = [], 0
    for s in range(sources):
        row = []
        for j in range(local):
            row.append(offset)
            offset += recv_per_expert[s][j]
        starts.append(row)
    pieces = [
        torch.arange(starts[s][j], starts[s][j] + recv_per_expert[s][j]) for j in range(local) for s in range(sources)
    ]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def run_grouped(
    rows: Tensor,
    recv_per_expert: Sequence[Sequence[int]],
    run_local: Callable[[Tensor, list[int]], Tensor],
) -> Tensor:
    """Reorder received rows expert-major, run ``run_local(rows, counts_per_local_expert)``, restore."""
    perm = _source_major_to_expert_major(recv_per_expert).to(rows.device)
    counts = [sum(col) for col in zip(*recv_per_expert)]
    out = run_local(rows[perm], counts)
    if rows.requires_grad and not out.requires_grad:
        # Experts that skip empty input (Hugging Face's eager loop returns fresh zeros) cut the
        # graph: without this link this rank would skip the backward all-to-alls its peers wait in.
        out = out + 0 * rows.sum()
    restored = torch.empty_like(out)
    restored[perm] = out
    return restored


def dispatch_and_combine(
    x: Tensor,
    plan: DispatchPlan,
    group,
    run_local: Callable[[Tensor, list[int]], Tensor],
) -> Tensor:
    """[T, h] tokens -> experts (wherever they live) -> weighted sum over each token's kept slots."""
    rows = exchange(x[plan.tokens], plan.send_splits, plan.recv_splits, group)
    rows = run_grouped(rows, plan.recv_per_expert, run_local)
    back = exchange(rows, plan.recv_splits, plan.send_splits, group)
    weighted = back * plan.weights.unsqueeze(-1).to(back.dtype)
    return torch.zeros_like(x).index_add(0, plan.tokens, weighted)
