"""All-to-all (Ulysses) context-parallel attention: a sequence shard becomes a head shard.

Every cp rank holds ``[b, h, s_local, d]`` for its sequence shard. One all-to-all per tensor
sends head group ``j`` (heads ``j·h/cp … (j+1)·h/cp − 1``) of the local shard to rank ``j``,
which then holds *all* ``cp·s_local`` positions of its ``h/cp`` heads, runs ordinary
attention over the whole sequence with the fused kernel (no merge, no ring), and one more
all-to-all returns each rank's sequence shard of the output with all heads. The head groups
of q and of K/V line up for grouped-query attention (query head ``i`` uses KV head
``i·hkv/hq``), so K/V travel with their own head count; both ``hq`` and ``hkv`` must be
divisible by cp.

Bytes per rank per attention call: the four all-to-alls of forward (q, k, v, out) each send
``(cp−1)/cp`` of the tensor; backward sends the same four again (dout in, dq, dk, dv out).

The all-to-all is its own adjoint's inverse: the gradient of "sequence → heads" is
"heads → sequence" applied to the gradient, and vice versa.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.parallel.context.kernel import block_backward, block_forward
from lightning_5d.parallel.context.ring import zigzag_shard, zigzag_unshard

__all__ = ["alltoall_attention", "check_alltoall_heads"]


def check_alltoall_heads(hq: int, hkv: int, cp: int) -> None:
    """Raise with the valid cp values unless ``cp`` divides both head counts."""
    if hq % cp == 0 and hkv % cp == 0:
        return
    common = math.gcd(hq, hkv)
    valid = [c for c in range(1, common + 1) if common % c == 0]
    raise ValueError(
        f'context.mode="alltoall" shards attention heads over cp={cp}, but this attention has {hq} query heads '
        f"and {hkv} KV heads (per tensor-parallel rank); cp must divide both: cp in {valid}. For a larger cp use "
        f'context.mode="ring" or "allgather".'
    )


def _exchange(x: Tensor, group: Any) -> Tensor:
    """all_to_all over dim 0 (``[cp, ...]``): block ``j`` goes to rank ``j``, block ``j`` received from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, group: Any, cp: int) -> Tensor:
    """``[b, h, s, d]`` sequence shard → ``[b, h/cp, cp·s, d]`` head shard, positions in rank-shard order."""
    b, h, s, d = x.shape
    blocks = x.view(b, cp, h // cp, s, d).transpose(0, 1)  # [cp (dest), b, h/cp, s, d]
    got = _exchange(blocks, group)  # [cp (source rank), b, h/cp, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(y: Tensor, group: Any, cp: int) -> Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    b, hl, n, d = y.shape
    s = n // cp
    blocks = y.view(b, hl, cp, s, d).permute(2, 0, 1, 3, 4)  # [cp (dest rank), b, h/cp, s, d]
    got = _exchange(blocks, group)  # [cp (source head group), b, h/cp, s, d]
    return got.transpose(0, 1).reshape(b, cp * hl, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):  # type: ignore[override]
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _heads_to_seq(grad, ctx.group, ctx.cp), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, cp):  # type: ignore[override]
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(y, group, cp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _seq_to_heads(grad, ctx.group, ctx.cp), None, None


class _FusedAttention(torch.autograd.Function):
    """Whole-sequence attention through the fused block kernel (one block, nothing to merge)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):  # type: ignore[override]
        out, lse = block_forward(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None


def _to_sequence_order(x: Tensor, cp: int, zigzag: bool) -> Tensor:
    return zigzag_unshard(list(x.chunk(cp, dim=2)), 2) if zigzag else x


def _to_rank_order(x: Tensor, cp: int, zigzag: bool) -> Tensor:
    return torch.cat([zigzag_shard(x, 2, r, cp) for r in range(cp)], dim=2) if zigzag else x


HeadShardAttention = Callable[[Tensor, Tensor, Tensor], Tensor]


def alltoall_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Any, cp: int, *, causal: bool, zigzag: bool, scale: float,
    inner: HeadShardAttention | None = None,
) -> Tensor:  # fmt: skip
    """Attention of this rank's sequence shard (``[b, hq, s_local, d]``; K/V ``[b, hkv, s_local, d]``).

    ``zigzag``: the shards follow :func:`zigzag_shard` (else contiguous shards in rank order).
    ``inner``: the attention of the head shard ``[b, h/cp, cp·s_local, d]`` (the ``cp`` shards
    of ``group`` in sequence order); default, the fused kernel over it as the whole sequence.
    The hybrid mode passes ring attention across the groups here: with zig-zag sharding, the
    ``cp`` shards of a group in sequence order are exactly the group's zig-zag shard of a ring
    over the groups (:mod:`lightning_5d.parallel.context.hybrid`).
    """
    check_alltoall_heads(q.size(1), k.size(1), cp)
    qh, kh, vh = (_SeqToHeads.apply(t, group, cp) for t in (q, k, v))
    qh, kh, vh = (_to_sequence_order(t, cp, zigzag) for t in (qh, kh, vh))
    out = _FusedAttention.apply(qh, kh, vh, scale, causal) if inner is None else inner(qh, kh, vh)
    return _HeadsToSeq.apply(_to_rank_order(out, cp, zigzag).contiguous(), group, cp)
