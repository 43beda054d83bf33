"""The ALiBi bias of one ring-attention block, built from the global positions of its tokens.

A model that builds its bias ``B[h, i, j] = m_h · δ(i, j)`` from ``arange(n)`` numbers a
shard's tokens 0..S/cp−1: its bias for the shard's own tokens is the global one only where the
local distances are the global ones (not across the two zig-zag chunks), and the blocks of keys
held by other ranks it never sees. Ring attention instead computes each block's bias from
where its tokens are in the whole sequence (:func:`shard_positions`), with the slopes read
from the bias the model passed (:func:`lightning_5d.plan.linear_bias.read_linear_bias`): the
scores of query ``i`` against key ``j`` get ``m_h · δ(pos_i, pos_j)`` whichever rank holds them,
so the merged softmax is the one-process softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_5d.plan.linear_bias import LinearBias

__all__ = ["BlockBias", "shard_positions"]


def shard_positions(rank: int, cp_size: int, s_local: int, zigzag: bool, device: torch.device) -> Tensor:
    """Global positions of the ``s_local`` tokens rank ``rank`` holds: chunks ``r`` and ``2cp−1−r``
    of ``2cp`` (zig-zag), or chunk ``r`` of ``cp`` (contiguous)."""
    if not zigzag:
        return torch.arange(rank * s_local, (rank + 1) * s_local, device=device)
    half = s_local // 2
    first, second = rank * half, (2 * cp_size - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half, device=device),
                      torch.arange(second, second + half, device=device)])  # fmt: skip


def _half(x: Tensor, half: int | None) -> Tensor:
    return x if half is None else x.narrow(0, half * (x.numel() // 2), x.numel() // 2)


@dataclass(frozen=True)
class BlockBias:
    """``bias`` between this rank's queries (at ``q_pos``) and one KV block (at ``k_pos``)."""

    bias: LinearBias
    q_pos: Tensor
    k_pos: Tensor

    def product(self, q_half: int | None, k_half: int | None, dtype: torch.dtype) -> Tensor:
        """``[heads, sq, sk]`` in ``dtype`` for the (halves of the) queries and keys a product uses."""
        return self.bias.scores(_half(self.q_pos, q_half), _half(self.k_pos, k_half)).to(dtype)
