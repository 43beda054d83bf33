"""Hybrid context-parallel attention: Ulysses inside groups of ``U`` cp ranks × ring across them.

Megatron-LM calls this ``a2a+p2p``. The ``cp`` ranks of a sequence form ``R = cp/U`` groups of
``U`` consecutive cp ranks (cp rank ``c = g·U + u``: group ``g``, position ``u``):

1. inside each group an all-to-all turns the ``U`` sequence shards into head shards
   (:func:`~lightning_5d.parallel.context.ulysses.alltoall_attention`): rank ``u`` of group
   ``g`` then holds heads ``u·h/U … (u+1)·h/U − 1`` of the group's ``U·s_local`` positions;
2. ring attention (:func:`~lightning_5d.parallel.context.ring.ring_attention`) runs over the
   ``R`` ranks that hold the same heads (one per group, the same ``u``), each with its
   group's positions as its sequence block;
3. the output's all-to-all returns every rank's sequence shard with all heads.

Why the ring needs no new layout: under zig-zag sharding over ``cp`` (``2·cp`` chunks, rank ``c``
holds chunks ``c`` and ``2·cp−1−c``), group ``g`` holds chunks ``g·U … g·U+U−1`` and their
mirror images, i.e. chunks ``g`` and ``2R−1−g`` of ``2R`` chunks ``U`` times longer: the ring's
own zig-zag shard over ``R`` ranks, once the all-to-all has put the positions in sequence order.
Contiguous sharding gives group ``g`` the contiguous super-chunk ``g``. So the causal block
schedule, the skipping of masked blocks and the balance carry over unchanged.

Bytes per rank per attention call: the Ulysses part sends ``(U−1)/U`` of q, k, v and the
output (forward) and of their gradients (backward); the ring passes K/V blocks of ``h_kv/U``
heads × ``U·s_local`` positions (as many bytes as the local K/V) over ``R − 1`` hops forward,
``R − 1`` backward, and the dK/dV accumulators over ``R`` hops. The heads per tensor-parallel
rank must divide by ``U`` (both query and KV heads); cp may exceed them, which Ulysses alone
(``U = cp``) does not allow.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch import Tensor

from lightning_5d.config import ContextParallelMode, LayoutError, SequenceSharding
from lightning_5d.parallel.context.ring import ring_attention
from lightning_5d.parallel.context.ulysses import alltoall_attention

__all__ = ["check_hybrid", "hybrid_attention", "valid_ulysses"]


def valid_ulysses(cp: int, heads: tuple[int, int] | None = None) -> list[int]:
    """The Ulysses group sizes ``U`` with ``1 < U < cp``, ``U | cp`` and (given ``(hq, hkv)``) ``U | hq, hkv``."""
    common = math.gcd(*heads) if heads is not None else cp
    return [u for u in range(2, cp) if cp % u == 0 and common % u == 0]


def check_hybrid(cp: int, ulysses: int | None, heads: tuple[int, int] | None = None) -> None:
    """Refuse a hybrid layout that cannot run, naming the valid ``context.ulysses`` values.

    ``heads``: the query and KV heads per tensor-parallel rank, when the model is known.
    """
    valid = valid_ulysses(cp, heads)
    hint = f"valid context.ulysses here: {valid}" if valid else "no hybrid split exists here"
    alternatives = "use context.mode='ring' (any cp) or 'alltoall' (cp dividing the heads)"
    if ulysses is None:
        raise LayoutError(
            f"context.mode='hybrid' needs context.ulysses, the cp ranks per all-to-all group; {hint}; "
            f"or {alternatives}."
        )
    if ulysses >= cp or cp % ulysses:
        raise LayoutError(
            f"context.ulysses={ulysses} must divide cp={cp} and be smaller than it (ulysses=cp is "
            f"context.mode='alltoall'); {hint}; or {alternatives}."
        )
    if heads is not None and (heads[0] % ulysses or heads[1] % ulysses):
        raise LayoutError(
            f"context.ulysses={ulysses} shards attention heads over each all-to-all group, but a tensor-parallel "
            f"rank holds {heads[0]} query and {heads[1]} KV heads; ulysses must divide both: {hint}; or {alternatives}."
        )


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, ulysses_group: Any, ulysses: int, ring_group: Any, *, causal: bool,
    sharding: SequenceSharding, scale: float, stats: dict | None = None,
) -> Tensor:  # fmt: skip
    """Attention of this rank's sequence shard (``[b, hq, s_local, d]``; K/V ``[b, hkv, s_local, d]``).

    ``ulysses_group``: the ``ulysses`` consecutive cp ranks of this rank's group, in cp order;
    ``ring_group``: the ranks at this rank's position in every group, in group order. ``stats``
    gets the ring's work and receive waits (see :func:`ring_attention`).
    """
    ring = functools.partial(ring_attention, group=ring_group, causal=causal, mode=ContextParallelMode.RING,
                             sharding=sharding, scale=scale, stats=stats)  # fmt: skip
    return alltoall_attention(q, k, v, ulysses_group, ulysses, causal=causal,
                              zigzag=sharding is SequenceSharding.ZIGZAG, scale=scale, inner=ring)  # fmt: skip
