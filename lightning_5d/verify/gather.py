"""Full shapes from a rank's parts: a piece's weights, and the activations it saw and made.

Weights: a ZeRO-3 (FSDP2) shard is a ``DTensor`` (``full_tensor()`` gathers it over the data
ranks); a tp cut is undone by the :class:`~lightning_5d.parallel.tensor.TensorShard` that made
it (fused segments included).

Activations follow the layouts the dimensions give them, read from their shapes against
the probe's sequence length ``S``:

* a ``DTensor`` (the head's vocabulary-sharded logits) → ``full_tensor()``;
* the sequence dim (dim 1 of a batch-first tensor, dim 0 of a 1-D position vector) of
  length ``S/(cp·tp)`` under sequence parallelism → concatenated over tp (SP cuts it
  contiguously), then of length ``S/cp`` → reassembled over cp in its sharding order
  (zig-zag: rank r holds chunks r and 2·cp−1−r);
* the last dim of a column-parallel projection's output → reassembled over tp with the
  projection's segments (a fused ``[q|k|v]`` is cut per segment).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_5d.config import SequenceSharding
from lightning_5d.parallel.context.ring import contiguous_unshard, zigzag_unshard
from lightning_5d.parallel.regions import chunk_ranges
from lightning_5d.parallel.tensor.sharding import TensorShard


def _gather_list(t: Tensor, group: dist.ProcessGroup, size: int) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


@dataclass(frozen=True)
class ActivationLayout:
    """How the probe's activations are cut on this rank (sizes 1 mean "not cut")."""

    seq_len: int
    tp: int = 1
    tp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None
    cp_sharding: SequenceSharding = SequenceSharding.ZIGZAG

    def full(self, value: Any) -> Any:
        """``value`` (a tensor, or tuples/lists/dicts of them) at the one-process shape."""
        if isinstance(value, (tuple, list)):
            return type(value)(self.full(v) for v in value)
        if isinstance(value, dict):
            return {k: self.full(v) for k, v in value.items()}
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if not isinstance(value, Tensor) or value.dim() == 0:
            return value
        dim = 1 if value.dim() >= 2 else 0
        if dim == 1 and self.cp > 1 and value.size(1) * self.cp != self.seq_len == value.size(0) * self.cp:
            dim = 0  # sequence first: a position embedding looked up on 1-D positions ([S/cp] -> [S/cp, hidden])
        length = value.size(dim)
        if self.sequence_parallel and self.tp > 1 and length * self.tp * self.cp == self.seq_len:
            value = torch.cat(_gather_list(value, self.tp_group, self.tp), dim=dim)
            length = value.size(dim)
        if self.cp > 1 and length * self.cp == self.seq_len:
            parts = _gather_list(value, self.cp_group, self.cp)
            unshard = zigzag_unshard if self.cp_sharding == SequenceSharding.ZIGZAG else contiguous_unshard
            value = unshard(parts, dim)
        return value

    def full_columns(self, value: Any, segments: tuple[int, ...]) -> Any:
        """A column-parallel projection's output: last dim over tp (per segment), then :meth:`full`."""
        if isinstance(value, Tensor) and not isinstance(value, DTensor) and self.tp > 1 and value.dim() >= 1:
            shard = TensorShard(value.dim() - 1, tuple(segments))
            value = shard.assemble(_gather_list(value, self.tp_group, self.tp))
        return self.full(value)


class HeldTensors(str, Enum):
    """What :func:`full_weights` returns for a tensor this rank holds whole (nothing to gather)."""

    # A copy, the caller's own: the live tensor goes away before the copy's last use (FSDP2's
    # unsharded parameters, freed when the unit reshards).
    COPY = "copy"
    # The live tensor itself (detached): it outlives the use, and a copy would only hold the
    # same numbers twice (a cp or pp rank's whole embedding). A wrapper subclass (FP8 weights
    # under FSDP2), whose storage cannot be told apart, is still copied.
    SHARE = "share"


def full_weights(
    live: nn.Module, prefix: str, names: Iterable[str], tp: Any | None, held: HeldTensors = HeldTensors.COPY
) -> dict[str, Tensor]:
    """Each named tensor of the live (parallel) piece at its full shape; ``prefix`` is its path.

    ``tp`` is the strategy's TensorParallel (or None): it knows how each parameter was cut.
    A collective over the data ranks (FSDP2 shards) and over tp: every rank holding this
    piece calls it with the same names in the same order. A gathered tensor is a fresh one;
    a tensor this rank holds whole is copied or shared as ``held`` says.
    """
    tensors = dict(live.named_parameters(remove_duplicate=False))
    tensors.update(dict(live.named_buffers(remove_duplicate=False)))
    out: dict[str, Tensor] = {}
    for name in names:
        if name not in tensors:
            raise KeyError(name)
        value = live_value = tensors[name]
        full_name = f"{prefix}.{name}" if prefix else name
        cut = tp.shards[full_name] if tp is not None and tp.is_sharded(full_name) and value.dim() > 0 else None
        if isinstance(value, DTensor):
            live_value = value._local_tensor
            whole = _tp_output(value, cut, tp)
            if whole is not None:  # the data ranks' shards straight into this rank's slice of the full tensor
                mine = _full_tensor(value, into=cut.slices(whole, tp.rank, tp.size)[0])
                value = _tp_full(mine, cut, tp, out=whole)
                cut = None
            else:
                value = _full_tensor(value)
        value = value.detach()
        if cut is not None:
            value = _tp_full(value, cut, tp)
        # A gather is a fresh tensor already; the rank's own tensor (unsharded, or replicated)
        # is copied only where the live one may go away first (or cannot be told apart).
        shared = _may_share_storage(value, live_value)
        plain = type(value) in (Tensor, nn.Parameter)
        out[name] = value.clone() if shared and (held == HeldTensors.COPY or not plain) else value
    return out


def _tp_output(value: DTensor, shard: TensorShard | None, tp: Any) -> Tensor | None:
    """The full tensor's memory for ``value`` (this rank's tp part, ZeRO-sharded), where that part
    is one contiguous slice of it (a vocabulary-parallel embedding or head, a plain column cut)
    and so can be gathered over the data ranks in place: the rank's whole part (94 MiB of the
    0.5 B model's head under tp2 x ZeRO-3) was otherwise held next to the full tensor (188 MiB)
    while tp assembled it. None otherwise (no tp cut, a row cut, fused segments, or a shard
    on another device than tp's collectives, as under CPU offload)."""
    if shard is None or value._local_tensor.device != tp.device:
        return None
    shape = list(value.shape)
    shape[shard.dim] *= tp.size
    slices = shard.slices(torch.empty(shape, dtype=value.dtype, device="meta"), tp.rank, tp.size)
    if len(slices) != 1 or not slices[0].is_contiguous():
        return None
    return torch.empty(shape, dtype=value.dtype, device=tp.device)


def _tp_full(local: Tensor, shard: TensorShard, tp: Any, out: Tensor | None = None) -> Tensor:
    """The full tensor of a tp cut (``shard``, fused segments included), allocated once.

    Each tp rank in turn broadcasts its part straight into its slices of the output (one
    contiguous slice: a vocabulary-parallel embedding or head, a plain column cut), or into
    one part-sized buffer copied into its slices (a row cut, fused segments). The gather
    through ``all_gather_into_tensor`` held a second full-size buffer on gloo: measured on a
    32000 x 2048 fp32 head under tp=2, +500 MiB for a 250 MiB weight.
    """
    size = tp.size
    shape = list(local.shape)
    shape[shard.dim] *= size
    if out is None:
        out = torch.empty(shape, dtype=local.dtype, device=tp.device)
    mine = local.detach().to(tp.device)
    for src in range(size):
        slices = shard.slices(out, src, size)
        if len(slices) == 1 and slices[0].is_contiguous():
            if src == tp.rank and slices[0].data_ptr() != mine.data_ptr():  # not written in place already
                slices[0].copy_(mine)
            dist.broadcast(slices[0], group=tp.group, group_src=src)
            continue
        part = mine.contiguous() if src == tp.rank else torch.empty_like(mine)
        dist.broadcast(part, group=tp.group, group_src=src)
        for view, piece in zip(slices, part.split([v.size(shard.dim) for v in slices], dim=shard.dim)):
            view.copy_(piece)
        del part
    return out.to(local.device)


def _may_share_storage(value: Tensor, live: Tensor) -> bool:
    """Whether ``value`` may be the live tensor's memory. A wrapper subclass (FP8 weights under
    FSDP2) has no plain storage to compare: counted as shared, so it is copied."""
    try:
        return value.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
    except RuntimeError:
        return True


def _full_tensor(value: DTensor, into: Tensor | None = None) -> Tensor:
    """``value.full_tensor()`` with the full tensor allocated once.

    DTensor's all-gather holds a second full-size buffer while it runs (measured on gloo,
    4 ranks, a 32000 x 1536 fp32 weight: +375 MiB for a 188 MiB tensor), which made the
    verifier's compare of the head peak at the rank's share plus twice the head. A weight
    sharded by rows on one mesh dimension (FSDP2's ``Shard(0)``, replicated on any other,
    as under HSDP) is instead broadcast by each rank straight into its rows of the output;
    any other placement goes through ``full_tensor()``. ``into``: where to write it (contiguous,
    of the full shape), else a new tensor.
    """
    shards = [(mesh_dim, p.dim) for mesh_dim, p in enumerate(value.placements) if p.is_shard()]
    if len(shards) != 1 or shards[0][1] != 0 or not all(p.is_shard() or p.is_replicate() for p in value.placements):
        return value.full_tensor() if into is None else into.copy_(value.full_tensor())
    mesh_dim = shards[0][0]
    mesh = value.device_mesh
    group, parts, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    local = value._local_tensor
    out = torch.empty(value.shape, dtype=value.dtype, device=local.device) if into is None else into
    for src in range(parts):
        for lo, hi in chunk_ranges(value.shape[0], parts, src):  # Shard(0) cuts as torch.chunk does
            rows = out[lo:hi]
            if src == me:
                rows.copy_(local)
            dist.broadcast(rows, group=group, group_src=src)
    return out
