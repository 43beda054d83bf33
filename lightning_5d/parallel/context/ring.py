"""Context-parallel attention: the sequence is sharded over the ranks of a cp process group.

Every rank holds a slice ``Q_i, K_i, V_i`` of the sequence (layout ``[b, heads, s_local, d]``
like ``F.scaled_dot_product_attention``). The output for the local queries is

    O_i = softmax(Q_i Kᵀ / √d) V = Σ_j softmax_j(Q_i K_jᵀ / √d) V_j

where the softmax over the whole key sequence is assembled block by block: each KV block
``j`` gives a partial output ``O_i^(j)`` (normalized within the block) and its row-wise
log-sum-exp ``lse_i^(j)``; two partial results merge exactly with

    lse = log(exp(lse_a) + exp(lse_b))
    O   = exp(lse_a - lse) · O_a + exp(lse_b - lse) · O_b

(the running max/sum rescaling of the online softmax, written in log space). Each block's
``(O_i^(j), lse_i^(j))`` comes from a fused attention kernel
(:mod:`lightning_5d.parallel.context.kernel`: PyTorch's CPU flash op, CUDA's memory-
efficient op) that never materializes the ``s_local × s_local`` scores; the block kernel
runs in the input dtype, the merge and the running ``(O_i, lse_i)`` are fp32 (fp64 stays
fp64).

Backward runs the fused backward kernel on each block with the saved *final* ``(O_i, lse_i)``
(then ``exp(Q_i K_jᵀ/√d − lse_i)`` is the block's slice of the whole softmax), accumulates
``dQ_i`` locally and returns each ``dK_j, dV_j`` to the rank that owns block ``j``.

Two communication modes (values of :class:`lightning_5d.config.ContextParallelMode`):

* ``ring``: KV blocks travel to the next rank with async point-to-point ops; the transfer of
  the next block is in flight while the current block is computed. In backward the KV
  blocks travel again together with their dK/dV accumulators, which end at their owner.
* ``allgather``: the full K/V is gathered once (more memory, one collective); backward
  re-gathers it and reduce-scatters dK/dV.

Causal attention with ``sharding="zigzag"`` expects the zig-zag layout (:func:`zigzag_shard`):
the sequence cut into ``2·cp`` chunks, rank ``r`` holding chunks ``r`` and ``2·cp−1−r``.
Fully masked block products are skipped and the causal mask is applied only on the
diagonal block, so every rank does the same amount of work (see :func:`block_schedule`).
With ``"contiguous"`` the layout is contiguous (:func:`contiguous_shard`) and rank ``r``
computes ``r+1`` blocks: the work is unbalanced.

An ALiBi bias (``bias``: per-head slopes times token distances, :mod:`.block_bias`) is added
to each product's scores, built from the global positions of its queries and keys; the
causal structure stays the schedule's (the ``-inf`` of a causal bias are never built).

Grouped-query attention (fewer KV heads than query heads): K/V keep their own head count
in the ring buffers (the bytes per hop scale with ``hkv``, not ``hq``); the CPU kernel takes
them as they are. The pure-math block attention of earlier versions is kept as the tests'
oracle in :mod:`lightning_5d.parallel.context.reference`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.config import ContextParallelMode, SequenceSharding
from lightning_5d.parallel.context.block_bias import BlockBias, shard_positions
from lightning_5d.parallel.context.kernel import block_backward, block_forward
from lightning_5d.plan.linear_bias import LinearBias

__all__ = [
    "BlockProduct",
    "block_schedule",
    "count_block_units",
    "contiguous_shard",
    "contiguous_unshard",
    "zigzag_shard",
    "zigzag_unshard",
    "merge_partial",
    "ring_attention",
]


# ---------------------------------------------------------------------------------------------
# sharding helpers
# ---------------------------------------------------------------------------------------------


def _check_divisible(length: int, parts: int, what: str) -> None:
    if length % parts != 0:
        raise ValueError(f"sequence length {length} is not divisible by {what}={parts}")


def contiguous_shard(x: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """Rank ``cp_rank``'s contiguous slice (chunk ``cp_rank`` of ``cp_size``) along ``dim``."""
    _check_divisible(x.size(dim), cp_size, "cp")
    return x.chunk(cp_size, dim=dim)[cp_rank]


def contiguous_unshard(shards: list[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`contiguous_shard`: ``shards`` in rank order."""
    return torch.cat(list(shards), dim=dim)


def zigzag_shard(x: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """Rank ``cp_rank``'s zig-zag slice: chunks ``r`` and ``2·cp−1−r`` of ``2·cp`` along ``dim``."""
    _check_divisible(x.size(dim), 2 * cp_size, "2*cp")
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def zigzag_unshard(shards: list[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`zigzag_shard`: ``shards`` (one per rank, rank order) back to sequence order."""
    cp_size = len(shards)
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for r, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp_size - 1 - r] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# block schedule: which products a rank computes against the KV block of rank ``src``
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockProduct:
    """One product of (part of) the local queries with (part of) a KV block.

    ``q_half`` / ``k_half``: ``None`` for the whole local slice, 0 or 1 for its first or
    second half (the two zig-zag chunks). ``diagonal``: apply the causal mask (the block
    holds the same positions as the queries). ``units``: work in quarter blocks
    ((s_local/2)² score entries), the unit in which per-rank work is compared.
    """

    q_half: int | None
    k_half: int | None
    diagonal: bool

    @property
    def units(self) -> int:
        return (2 if self.q_half is None else 1) * (2 if self.k_half is None else 1)


def block_schedule(rank: int, src: int, cp_size: int, causal: bool, zigzag: bool) -> list[BlockProduct]:
    """Products rank ``rank`` computes with the KV block owned by rank ``src`` (empty: skipped).

    Contiguous causal: block ``src < rank`` is fully visible, ``src == rank`` is the diagonal,
    ``src > rank`` is fully masked. Zig-zag causal (rank holds chunks ``rank`` and
    ``2cp−1−rank``): ``src < rank`` — all queries see the first KV chunk only;
    ``src > rank`` — only the second query chunk sees anything, and sees the whole block.
    """
    if not 0 <= rank < cp_size or not 0 <= src < cp_size:
        raise ValueError(f"rank={rank}, src={src} out of range for cp={cp_size}")
    if not causal:
        return [BlockProduct(None, None, False)]
    if src == rank:
        return [BlockProduct(None, None, True)]  # local positions increase: a plain causal mask
    if not zigzag:
        return [BlockProduct(None, None, False)] if src < rank else []
    if src < rank:
        return [BlockProduct(None, 0, False)]
    return [BlockProduct(1, None, False)]


def count_block_units(rank: int, cp_size: int, causal: bool, zigzag: bool) -> int:
    """Total work (quarter-block units) of rank ``rank`` over all KV blocks, forward pass."""
    return sum(p.units for src in range(cp_size) for p in block_schedule(rank, src, cp_size, causal, zigzag))


# ---------------------------------------------------------------------------------------------
# block products through the fused kernel; q: [b, hq, s, d], kv: [2, b, hkv, s, d]
# ---------------------------------------------------------------------------------------------


def _half(x: Tensor, half: int | None, dim: int) -> Tensor:
    if half is None:
        return x
    n = x.size(dim) // 2
    return x.narrow(dim, half * n, n)


def merge_partial(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial results ``(O_a, lse_a)``, ``(O_b, lse_b)`` (fp32).

    ``lse = log(e^lse_a + e^lse_b)``, ``O = e^(lse_a−lse) O_a + e^(lse_b−lse) O_b``. A running
    ``lse_a = −inf`` (nothing seen yet) contributes zero weight.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return new_out, new_lse


def _merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, q_half: int | None) -> None:
    """:func:`merge_partial` written into the running ``(out, lse)`` in place.

    ``O ← e^(lse_a−lse)·O`` then ``O += e^(lse_b−lse)·O_b`` (``addcmul_``): no output-sized
    temporary, where the out-of-place merge holds three at once (RSS per rank at long S).
    """
    o_view, l_view = _half(out, q_half, -2), _half(lse, q_half, -1)
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(l_view, block_lse)
    o_view.mul_(torch.exp(l_view - new_lse).unsqueeze(-1))
    o_view.addcmul_(block_out.to(out.dtype), torch.exp(block_lse - new_lse).unsqueeze(-1))
    l_view.copy_(new_lse)


def _product_bias(bias: BlockBias | None, p: BlockProduct, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.product(p.q_half, p.k_half, dtype)


def _apply_products(
    state: tuple[Tensor, Tensor], q: Tensor, kv: Tensor, scale: float, products: list[BlockProduct],
    bias: BlockBias | None = None,
) -> int:  # fmt: skip
    """Merge the block's fused-kernel results ``(O^(j), lse^(j))`` into the running ``state``."""
    out, lse = state
    units = 0
    for p in products:
        k = _half(kv[0].to(q.dtype), p.k_half, -2)
        v = _half(kv[1].to(q.dtype), p.k_half, -2)
        block_bias = _product_bias(bias, p, q.dtype)
        block_out, block_lse = block_forward(_half(q, p.q_half, -2), k, v, scale, p.diagonal, block_bias)
        _merge_into(out, lse, block_out, block_lse, p.q_half)
        units += p.units
    return units


def _backward_products(
    q: Tensor, kv: Tensor, do: Tensor, out: Tensor, lse: Tensor, dq: Tensor, dkv: Tensor, scale: float,
    products: list[BlockProduct], bias: BlockBias | None = None,
) -> int:  # fmt: skip
    """Accumulate the block's contributions into ``dq`` (local) and ``dkv`` ([2, ...], fp32).

    The fused backward gets the rows' *final* ``out``/``lse``: ``exp(S − lse)`` is then this
    block's slice of the whole-sequence softmax, so the per-block gradients sum to the exact
    ones and the partial ``lse^(j)`` of forward needs no gradient of its own.
    """
    units = 0
    for p in products:
        k = _half(kv[0].to(q.dtype), p.k_half, -2)
        v = _half(kv[1].to(q.dtype), p.k_half, -2)
        sel = lambda x, dim=-2: _half(x, p.q_half, dim)  # noqa: E731
        block_bias = _product_bias(bias, p, q.dtype)
        bdq, bdk, bdv = block_backward(sel(do), sel(q), k, v, sel(out), sel(lse, -1), scale, p.diagonal, block_bias)
        sel(dq).add_(bdq)
        _half(dkv[0], p.k_half, -2).add_(bdk)
        _half(dkv[1], p.k_half, -2).add_(bdv)
        units += p.units
    return units


# ---------------------------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------------------------


def _group_info(group: Any) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _RingShift:
    """Async send of a tensor to the next rank and receive of the previous rank's into a new buffer."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        self.prev = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size

    def start(self, tensor: Tensor) -> tuple[Tensor, list]:
        tensor = tensor.contiguous()
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> float:
        """Block until the transfers are done; returns the seconds spent waiting (overlap left over)."""
        start = time.perf_counter()
        for w in works:
            w.wait()
        return time.perf_counter() - start


def _all_gather_kv(kv: Tensor, group: Any, size: int) -> Tensor:
    flat = torch.empty((size * kv.size(0), *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(flat, kv.contiguous(), group=group)
    return flat.view(size, *kv.shape)


# ---------------------------------------------------------------------------------------------
# autograd function
# ---------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs; fp64 inputs stay fp64 (exact checks, gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _block_bias(
    bias: LinearBias | None, rank: int, size: int, s_local: int, zigzag: bool, device: torch.device, src: int
) -> BlockBias | None:  # fmt: skip
    """The bias between this rank's queries and the KV block of rank ``src`` (None without a bias)."""
    if bias is None:
        return None
    return BlockBias(bias, shard_positions(rank, size, s_local, zigzag, device),
                     shard_positions(src, size, s_local, zigzag, device))  # fmt: skip


def _record(stats: dict | None, key: str, amount: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + amount


class _RingAttention(torch.autograd.Function):
    """q: [b, hq, s, d], kv: [2, b, hkv, s, d] (K/V unrepeated). Returns out in q's layout and dtype.

    The block kernels run in the input dtype; the running ``(O, lse)``, dQ and the travelling
    dK/dV accumulators are fp32 (fp64 stays fp64).
    """

    @staticmethod
    def forward(ctx, q, kv, group, causal, mode, zigzag, scale, stats, bias):  # type: ignore[override]
        rank, size = _group_info(group)
        block_bias = functools.partial(_block_bias, bias, rank, size, q.size(2), zigzag, q.device)
        cdt = _compute_dtype(q.dtype)
        # out keeps q's memory layout: models lay q out as [b, s, h, d] and transpose, so their
        # out.transpose(1, 2).reshape(b, s, h·d) after attention is then a view, not a copy.
        out = torch.zeros_like(q, dtype=cdt)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cdt, device=q.device)
        units = 0
        if size == 1:
            products = block_schedule(0, 0, 1, causal, zigzag)
            units += _apply_products((out, lse), q, kv, scale, products, block_bias(0))
        elif mode is ContextParallelMode.ALL_GATHER:
            full = _all_gather_kv(kv, group, size)
            for src in range(size):
                products = block_schedule(rank, src, size, causal, zigzag)
                units += _apply_products((out, lse), q, full[src], scale, products, block_bias(src))
        else:
            shift = _RingShift(group, rank, size)
            current = kv.contiguous()
            waited = 0.0
            for step in range(size):
                if step + 1 < size:  # the next block travels while this one is computed
                    incoming, works = shift.start(current)
                src = (rank - step) % size
                products = block_schedule(rank, src, size, causal, zigzag)
                units += _apply_products((out, lse), q, current, scale, products, block_bias(src))
                if step + 1 < size:
                    waited += shift.wait(works)
                    current = incoming
            _record(stats, "forward_recv_wait_s", waited)
        _record(stats, "forward_units", units)
        out = out.to(q.dtype)
        lse = lse.to(torch.promote_types(lse.dtype, torch.float32)).contiguous()
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.causal, ctx.mode, ctx.zigzag, ctx.scale, ctx.stats = group, causal, mode, zigzag, scale, stats
        ctx.bias = bias
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, kv, out, lse = ctx.saved_tensors
        group, causal, mode, zigzag, scale = ctx.group, ctx.causal, ctx.mode, ctx.zigzag, ctx.scale
        rank, size = _group_info(group)
        block_bias = functools.partial(_block_bias, ctx.bias, rank, size, q.size(2), zigzag, q.device)
        cdt = _compute_dtype(q.dtype)
        do = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        units = 0
        if size == 1:
            dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
            products = block_schedule(0, 0, 1, causal, zigzag)
            units += _backward_products(q, kv, do, out, lse, dq, dkv, scale, products, block_bias(0))
        elif mode is ContextParallelMode.ALL_GATHER:
            full = _all_gather_kv(kv, group, size)
            dfull = torch.zeros(full.shape, dtype=cdt, device=kv.device)
            for src in range(size):
                products = block_schedule(rank, src, size, causal, zigzag)
                units += _backward_products(q, full[src], do, out, lse, dq, dfull[src], scale, products,
                                            block_bias(src))  # fmt: skip
            dkv = torch.empty(kv.shape, dtype=cdt, device=kv.device)
            dist.reduce_scatter_tensor(dkv, dfull.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
        else:
            # KV blocks travel as in forward; each block's dK/dV accumulator travels one step
            # behind it and, after the last step, one more hop lands it on the block's owner.
            shift = _RingShift(group, rank, size)
            current = kv.contiguous()
            dkv_works: list = []
            dkv_incoming: Tensor | None = None
            waited = 0.0
            for step in range(size):
                if step + 1 < size:
                    incoming, kv_works = shift.start(current)
                src = (rank - step) % size
                local = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
                products = block_schedule(rank, src, size, causal, zigzag)
                units += _backward_products(q, current, do, out, lse, dq, local, scale, products, block_bias(src))
                if dkv_incoming is not None:  # the previous ranks' accumulation for block ``src``
                    waited += shift.wait(dkv_works)
                    local.add_(dkv_incoming)
                dkv_incoming, dkv_works = shift.start(local)
                if step + 1 < size:
                    waited += shift.wait(kv_works)
                    current = incoming
            waited += shift.wait(dkv_works)
            dkv = dkv_incoming
            _record(ctx.stats, "backward_recv_wait_s", waited)
        _record(ctx.stats, "backward_units", units)
        return dq.to(q.dtype), dkv.to(kv.dtype), None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# public entry
# ---------------------------------------------------------------------------------------------


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Any = None,
    *,
    causal: bool,
    mode: ContextParallelMode | str = ContextParallelMode.RING,
    sharding: SequenceSharding | str = SequenceSharding.ZIGZAG,
    scale: float | None = None,
    stats: dict | None = None,
    bias: LinearBias | None = None,
) -> Tensor:
    """Attention of the local queries against the whole sequence sharded over ``group``.

    ``q``: ``[b, hq, s_local, d]``; ``k``, ``v``: ``[b, hkv, s_local, d]`` with ``hq % hkv == 0``.
    For causal attention the shards must follow :func:`zigzag_shard` (``sharding="zigzag"``) or
    :func:`contiguous_shard` (``"contiguous"``); non-causal attention accepts either.
    ``stats``: optional dict; the work done (quarter-block units, see :class:`BlockProduct`)
    is added under ``"forward_units"`` / ``"backward_units"``, and in ring mode the seconds
    spent blocked on receives (what the compute of the current block did not hide) under
    ``"forward_recv_wait_s"`` / ``"backward_recv_wait_s"``. ``bias``: an ALiBi bias (slopes for
    1 or ``hq`` heads) added to the scores at the tokens' global positions under ``sharding``;
    its ``causal`` must be ``causal``. Returns ``[b, hq, s_local, d]``.
    """
    mode = ContextParallelMode(mode.value if isinstance(mode, Enum) else mode)
    if mode not in (ContextParallelMode.RING, ContextParallelMode.ALL_GATHER):
        raise ValueError(f"ring_attention runs mode ring or allgather, got {mode.value!r}; for alltoall call "
                         f"lightning_5d.parallel.context.ulysses.alltoall_attention")  # fmt: skip
    zigzag = SequenceSharding(sharding.value if isinstance(sharding, Enum) else sharding) is SequenceSharding.ZIGZAG
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected [b, heads, s_local, d] tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, hq, s, d = q.shape
    hkv = k.size(1)
    if k.size(0) != b or k.size(2) != s or k.size(3) != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, local length or head dim")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if causal and zigzag and s % 2 != 0:
        raise ValueError(f"zig-zag needs an even local sequence length (two chunks per rank), got {s}")
    if bias is not None:
        if len(bias.slopes) not in (1, hq) or bias.causal != causal:
            raise ValueError(f"bias with {len(bias.slopes)} slopes (causal={bias.causal}) for {hq} query heads "
                             f"(causal={causal}): expected 1 or {hq} slopes and the same causality")  # fmt: skip
        if zigzag and s % 2 != 0:
            raise ValueError(f"zig-zag positions need an even local sequence length (two chunks per rank), got {s}")
        if not any(bias.slopes):
            bias = None  # all slopes 0: a constant bias, which softmax ignores
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv = torch.stack([k, v])  # [2, b, hkv, s, d]: one buffer per ring hop, K/V not repeated
    return _RingAttention.apply(q, kv, group, causal, mode, zigzag, scale, stats, bias)
