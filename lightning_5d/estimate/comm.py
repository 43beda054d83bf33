"""Communication per optimizer step, per parallel dimension and collective, for one rank.

Convention: bytes *sent by one rank*, ring algorithms. For a collective over n ranks on a
tensor of S bytes: all-reduce ``2(n-1)/n * S``, all-gather / reduce-scatter ``(n-1)/n * S``
(S = the full, gathered tensor), all-to-all ``(n-1)/n * S`` (S = the local buffer), send
``S``. For large n this is the playbook's accounting: DP all-reduce 2Psi, ZeRO-1/2
reduce-scatter + all-gather 2Psi, ZeRO-3 3Psi (two all-gathers and a reduce-scatter).

M = microbatches per step (m * grad_accum), L/p layers on the rank, e activation bytes,
s local sequence (seq/cp), b micro-batch size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_5d.config import ActivationCheckpointing, ContextParallelMode, LayoutError, ZeroStage

from .memory import ACTIVATION_BYTES, DEFAULT_BUCKET_BYTES, bytes_per_param
from .params import RankParams, Stage, kv_heads_per_rank
from .spec import ModelSpec
from .training import Precision, TrainingSetup

DIMENSIONS = ("dp", "tp", "cp", "pp", "ep")


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


class Link(str, Enum):
    INTRA = "intra_node"
    INTER = "inter_node"


_RING_FACTOR = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.ALL_GATHER: lambda n: (n - 1) / n,
    Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Collective.ALL_TO_ALL: lambda n: (n - 1) / n,
    Collective.SEND_RECV: lambda n: 1.0,
}


def ring_bytes(collective: Collective, size_bytes: float, n: int) -> float:
    """Bytes one rank sends for one call of ``collective`` on an S-byte tensor over n ranks."""
    return _RING_FACTOR[Collective(collective)](n) * size_bytes


@dataclass(frozen=True)
class CommEntry:
    dim: str  # one of DIMENSIONS
    collective: Collective
    group_size: int
    calls: int  # per optimizer step
    bytes_per_call: float  # S, see ring_bytes
    link: Link
    what: str
    launches_per_call: int = 1  # kernels one logical call becomes (DP buckets, ZeRO-3 per layer)

    @property
    def bytes_per_rank(self) -> float:
        return self.calls * ring_bytes(self.collective, self.bytes_per_call, self.group_size)

    @property
    def launches(self) -> int:
        return self.calls * self.launches_per_call

    def as_dict(self) -> dict:
        return {
            "dim": self.dim,
            "collective": self.collective.value,
            "group_size": self.group_size,
            "calls": self.calls,
            "bytes_per_call": self.bytes_per_call,
            "bytes_per_rank": self.bytes_per_rank,
            "link": self.link.value,
            "what": self.what,
        }


def group_link(setup: TrainingSetup, dims: Sequence[str], gpus_per_node: int) -> Link:
    """Whether a process group over ``dims`` stays inside one node.

    Ranks are laid out by ``rank_order`` (outermost first, innermost contiguous). A group spans
    the block from its outermost dim inwards; if that block fits in a node, so does the group.
    """
    order = setup.rank_order
    outermost = min(order.index(d) for d in dims)
    span = math.prod(getattr(setup, d) for d in order[outermost:])
    return Link.INTRA if span <= gpus_per_node else Link.INTER


def _ep_link(setup: TrainingSetup, gpus_per_node: int) -> Link:
    # The ep group borrows the innermost ep ranks of dp_shard x cp, so it spans ep * (dims inside cp).
    order = setup.rank_order
    inner = math.prod(getattr(setup, d) for d in order[order.index("cp") + 1 :])
    return Link.INTRA if setup.ep * inner <= gpus_per_node else Link.INTER


def _ulysses_link(setup: TrainingSetup, gpus_per_node: int) -> Link:
    # The hybrid mode's all-to-all groups are the innermost cp_ulysses ranks of cp: they span
    # cp_ulysses * (dims inside cp) ranks.
    if setup.cp_ulysses is None:
        return group_link(setup, ("cp",), gpus_per_node)
    order = setup.rank_order
    inner = math.prod(getattr(setup, d) for d in order[order.index("cp") + 1 :])
    return Link.INTRA if setup.cp_ulysses * inner <= gpus_per_node else Link.INTER


def _grad_bytes(setup: TrainingSetup) -> int:
    """Gradients are reduced in fp32 when they are kept in fp32, else in bf16."""
    return 4 if setup.precision == Precision.FP32 or setup.fp32_grad_accumulation else 2


@dataclass(frozen=True)
class _DataLinks:
    shard: Link  # the ZeRO group, dp_shard x cp
    replicate: Link  # across dp_replicate (HSDP)
    all: Link  # every data and cp rank (plain DP)


def data_parallel_comm(
    setup: TrainingSetup,
    psi: float,
    shard_group: int,
    links: _DataLinks,
    label: str,
    layers: int,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
) -> list[CommEntry]:
    """Gradient sync and ZeRO traffic for ``psi`` parameters sharded over ``shard_group`` ranks.

    Z0: one all-reduce per step (no sync until the last microbatch). Z1: reduce-scatter grads,
    all-gather updated params, once per step. Z2: the reduce-scatter runs every microbatch
    (grads are sharded, so they cannot accumulate unsharded), the all-gather once. Z3: all-gather
    before forward and again before backward, reduce-scatter after backward, every microbatch,
    one layer at a time; under pp the reduce-scatter runs once per pipeline run. A dp_replicate > 1 (HSDP) adds an all-reduce of the shard across replicas.
    """
    if psi <= 0:
        return []
    grads, params = psi * _grad_bytes(setup), psi * bytes_per_param(setup.precision)[0]
    M, r, n, zero = setup.microbatches_per_step, setup.dp_replicate, shard_group, setup.zero

    def buckets(size: float) -> int:
        return max(1, math.ceil(size / bucket_bytes))

    def entry(coll: Collective, group: int, calls: int, size: float, link: Link, what: str, launches: int):
        return CommEntry("dp", coll, group, calls, size, link, f"{label} {what}", launches)

    if zero == ZeroStage.NONE or n == 1:
        if r * n == 1:
            return []
        return [entry(Collective.ALL_REDUCE, r * n, 1, grads, links.all, "grads", buckets(grads))]
    reductions = 1 if zero == ZeroStage.OPTIMIZER else M
    if zero == ZeroStage.PARAMETERS:
        out = [
            entry(Collective.ALL_GATHER, n, 2 * M, params, links.shard, "params (fwd+bwd)", layers),
            # Under pp the units hold gradients for the whole schedule run and reduce once after it.
            entry(Collective.REDUCE_SCATTER, n, setup.grad_accum if setup.pp > 1 else M, grads, links.shard,
                  "grads", layers),  # fmt: skip
        ]
    else:
        out = [
            entry(Collective.REDUCE_SCATTER, n, reductions, grads, links.shard, "grads", buckets(grads)),
            entry(Collective.ALL_GATHER, n, 1, params, links.shard, "updated params", buckets(params)),
        ]
    if r > 1:
        shard = grads / n
        what = "grad shards across replicas"
        out.append(entry(Collective.ALL_REDUCE, r, reductions, shard, links.replicate, what, buckets(shard)))
    return out


def comm_per_step(
    spec: ModelSpec, setup: TrainingSetup, rank: RankParams, stage: Stage, gpus_per_node: int = 8
) -> list[CommEntry]:
    """Every collective one rank of ``stage`` takes part in during one optimizer step."""
    e = ACTIVATION_BYTES[setup.precision]
    M, L = setup.microbatches_per_step, rank.layers
    s, b, h, t = setup.seq_len / setup.cp, setup.micro_batch_size, spec.hidden_size, setup.tp
    act = e * s * b * h  # one full (sequence-local) hidden-state tensor
    full = setup.recompute == ActivationCheckpointing.FULL
    first, last = setup.pp == 1 or stage == Stage.FIRST, setup.pp == 1 or stage == Stage.LAST

    def link(*dims: str) -> Link:
        return group_link(setup, dims, gpus_per_node)

    # DP / ZeRO: dense weights over dp_shard*cp, experts over (dp_shard*cp)/ep.
    links = _DataLinks(link("dp_shard", "cp"), link("dp_replicate"), link("dp_replicate", "dp_shard", "cp"))
    out = data_parallel_comm(setup, rank.dense, setup.zero_group, links, "dense", L)
    out += data_parallel_comm(setup, rank.expert, setup.zero_group // setup.ep, links, "expert", L)

    if t > 1:
        tp = link("tp")
        # Per layer and microbatch: forward 2 all-reduces (after attention and MLP), backward 2 more;
        # with SP each all-reduce becomes an all-gather + reduce-scatter pair of the same total volume.
        calls = 2 * (3 if full else 2) * L * M  # full recompute replays the forward collectives
        if setup.sp:
            out.append(CommEntry("tp", Collective.ALL_GATHER, t, calls, act, tp, "SP block boundaries"))
            out.append(CommEntry("tp", Collective.REDUCE_SCATTER, t, calls, act, tp, "SP block boundaries"))
        else:
            out.append(CommEntry("tp", Collective.ALL_REDUCE, t, calls, act, tp, "TP block outputs"))
        if first:
            coll = Collective.REDUCE_SCATTER if setup.sp else Collective.ALL_REDUCE
            out.append(CommEntry("tp", coll, t, M, act, tp, "vocab-parallel embedding"))
        if last:
            if setup.sp:
                out.append(CommEntry("tp", Collective.ALL_GATHER, t, M, act, tp, "head input"))
                out.append(CommEntry("tp", Collective.REDUCE_SCATTER, t, M, act, tp, "head input grad"))
            else:
                out.append(CommEntry("tp", Collective.ALL_REDUCE, t, M, act, tp, "head input grad"))
            stats = 4 * s * b  # one fp32 number per token: max, sum of exp, target logit
            out.append(CommEntry("tp", Collective.ALL_REDUCE, t, 3 * M, stats, tp, "vocab-parallel loss"))

    if setup.cp > 1:
        out.extend(context_parallel_comm(spec, setup, L, M, full, link("cp"), _ulysses_link(setup, gpus_per_node)))

    if setup.pp > 1:
        boundary = act / (t if setup.sp else 1)
        # A middle stage sends an activation forward and a gradient backward per microbatch and chunk.
        sends = 2 * setup.v * M
        out.append(CommEntry("pp", Collective.SEND_RECV, setup.pp, sends, boundary, link("pp"), "stage boundaries"))
        if spec.tie_embeddings and (first or last):
            vh = spec.vocab_size * h / t * _grad_bytes(setup)
            out.append(CommEntry("pp", Collective.ALL_REDUCE, 2, 1, vh, link("pp"), "tied embedding grads"))

    if setup.ep > 1 and spec.is_moe:
        tokens = s * b / (t if setup.sp else 1)
        payload = e * tokens * spec.experts_top_k * h
        calls = (6 if full else 4) * L * M  # dispatch + combine, forward and backward (+ replayed forward)
        ep = _ep_link(setup, gpus_per_node)
        out.append(CommEntry("ep", Collective.ALL_TO_ALL, setup.ep, calls, payload, ep, "MoE dispatch/combine"))
    return out


def context_parallel_comm(
    spec: ModelSpec, setup: TrainingSetup, layers: int, microbatches: int, full_recompute: bool, link: Link,
    ulysses_link: Link | None = None,
) -> list[CommEntry]:  # fmt: skip
    """Attention's cp traffic per step for ``setup.cp_mode`` (parallel/context/ring.py, ulysses.py,
    hybrid.py).

    Per layer and microbatch, with the local K/V block ``kv = 2·e·s·b·d·g/t`` bytes:

    * ring: forward passes K/V around the ring (cp−1 hops); backward passes K/V again (cp−1)
      and the dK/dV accumulators, which take cp hops (the last returns each to its owner).
    * allgather: forward all-gathers K/V; backward all-gathers it again and reduce-scatters dK/dV.
    * alltoall: forward turns q, k, v into head shards and the output back (4 all-to-alls);
      backward the same four on the gradients. Each sends (cp−1)/cp of the local tensor.
    * hybrid (``U = setup.cp_ulysses``, ``R = cp/U``): the alltoall traffic over groups of U
      ranks, then the ring's over R ranks; the ring's K/V block (h_kv/U heads of U·s positions)
      has the local block's bytes. ``ulysses_link``: the U-rank groups' link (consecutive cp
      ranks, often inside a node where the cp group is not).

    Full recompute replays the forward's traffic.
    """
    cp, e = setup.cp, ACTIVATION_BYTES[setup.precision]
    tokens = e * setup.seq_len / cp * setup.micro_batch_size * spec.d_head
    kv_block = 2 * tokens * kv_heads_per_rank(spec, setup.tp)
    forwards = (2 if full_recompute else 1) * layers * microbatches
    backwards = layers * microbatches
    mode = setup.cp_mode
    if mode is ContextParallelMode.ALL_GATHER:
        gathered = cp * kv_block
        return [
            CommEntry("cp", Collective.ALL_GATHER, cp, forwards + backwards, gathered, link, "all-gather K/V"),
            CommEntry("cp", Collective.REDUCE_SCATTER, cp, backwards, gathered, link, "reduce-scatter dK/dV"),
        ]
    q_heads, kv_heads = spec.num_heads // setup.tp, kv_heads_per_rank(spec, setup.tp)
    ulysses = cp_ulysses_size(setup, (q_heads, kv_heads))
    ring = cp // ulysses
    out = []
    if ulysses > 1:
        calls = 2 * (forwards + backwards)  # q, out / dout, dq; and k, v / dk, dv
        where = link if ulysses == cp or ulysses_link is None else ulysses_link
        out += [
            CommEntry("cp", Collective.ALL_TO_ALL, ulysses, calls, tokens * q_heads, where,
                      "all-to-all q, out (Ulysses)"),
            CommEntry("cp", Collective.ALL_TO_ALL, ulysses, calls, kv_block / 2, where, "all-to-all k, v (Ulysses)"),
        ]  # fmt: skip
    if ring > 1:
        hops = (ring - 1) * (forwards + backwards) + ring * backwards
        out.append(CommEntry("cp", Collective.SEND_RECV, ring, hops, kv_block, link, "ring K/V, dK/dV"))
    return out


def cp_ulysses_size(setup: TrainingSetup, heads: tuple[int, int]) -> int:
    """The all-to-all group size of ``setup.cp_mode`` (1: ring only), checked against the heads per tp rank."""
    cp, mode = setup.cp, setup.cp_mode
    if mode is ContextParallelMode.ALL_TO_ALL:
        if heads[0] % cp or heads[1] % cp:
            raise LayoutError(
                f"cp_mode=alltoall shards attention heads over cp={cp}, but a tp={setup.tp} rank holds {heads[0]} "
                f"query and {heads[1]} KV heads; cp must divide both (or use cp_mode=ring or hybrid)."
            )
        return cp
    if mode is ContextParallelMode.HYBRID:
        from lightning_5d.parallel.context.hybrid import check_hybrid

        check_hybrid(cp, setup.cp_ulysses, heads)
        return setup.cp_ulysses
    return 1


def bytes_by_dim(entries: Iterable[CommEntry]) -> dict[str, float]:
    """Stable summary: one key per dimension (0 when unused) plus ``total``."""
    out = {d: 0.0 for d in DIMENSIONS}
    for entry in entries:
        out[entry.dim] += entry.bytes_per_rank
    out["total"] = sum(out[d] for d in DIMENSIONS)
    return out
