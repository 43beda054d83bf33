"""Each parallel gradient compared where it lives: this rank's shard against the matching
slice of the reference gradient, the sums added (or the worst taken) over the tp ranks.

Gathering every parallel gradient to its full shape held, for the largest piece (a
32000 x 2048 vocabulary-parallel embedding or head), the full gradient next to the full
reference weight and gradient. Instead, for a parameter that tp cut (its
:class:`~lightning_5d.parallel.tensor.TensorShard`, fused segments included), rank ``r``
compares its gradient ``g_r`` with the views ``slices(g_ref, r)`` the same cut gives of
the full reference gradient, and the sums of :class:`~.compare.GapSums` add up over the tp
ranks to the full tensor's:

    Σ_r Σ(g_r − slice_r(g_ref))² = ‖g_par − g_ref‖²,   Σ_r Σ slice_r(g_ref)² = ‖g_ref‖²

so the relative error is the one the full-shape comparison gave. A parameter every tp rank
holds whole (a norm, a replicated bias) is compared on each rank, and the worst rank's
numbers are kept: a rank whose copy lacks the tp sum (a per-head q/k norm that saw only its
heads) fails for every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.verify.compare import Difference, GapSums

# Why a gradient could not be measured (the column reduced by MAX over the tp ranks).
_NONE, _NON_FINITE, _SHAPE = 0, 1, 2


@dataclass(frozen=True)
class RankPart:
    """The slices of a full reference gradient that this tp rank's shard is compared with, in
    one tensor along the cut dimension (and the full gradient's shape, for the message)."""

    part: Tensor
    full_shape: tuple[int, ...]


def rank_part(reference: Tensor, shard: Any, rank: int, size: int) -> RankPart:
    """This rank's slices of the full ``reference`` as ``shard`` cuts it, copied out."""
    return RankPart(torch.cat(shard.slices(reference, rank, size), dim=shard.dim), tuple(reference.shape))


def keep_rank_parts(reference: dict[str, Tensor], prefix: str, tp: Any | None) -> None:
    """Replace, in place, each full reference gradient of a parameter tp cut by this rank's
    part of it, freeing the full one before the parallel backward runs: on the 0.5 B model's
    vocabulary-parallel head under tp2 x ZeRO-3 the full 188 MiB gradient was held next to
    the rank's gathered 94 MiB weight and its 94 MiB gradient; the part is 94 MiB."""
    if tp is None:
        return
    for name in list(reference):
        full_name = f"{prefix}.{name}" if prefix else name
        if tp.is_sharded(full_name):
            reference[name] = rank_part(reference[name], tp.shards[full_name], tp.rank, tp.size)


def part_sums(local: Tensor, part: RankPart, rank: int) -> GapSums | str:
    """The sums of ``local`` (this rank's shard) against its part of the reference; a note when
    the shapes do not correspond."""
    if tuple(local.shape) != tuple(part.part.shape):
        return (f"shape {tuple(local.shape)} on tp rank {rank} where the model's {part.full_shape}, "
                f"cut by tp, gives {tuple(part.part.shape)}")  # fmt: skip
    return GapSums().add(local, part.part)


def shard_sums(local: Tensor, reference: Tensor, shard: Any, rank: int, size: int) -> GapSums | str:
    """The sums of ``local`` (this rank's part, cut by ``shard``) against the matching slices
    of the full ``reference``; a note when the shapes do not correspond."""
    return part_sums(local, rank_part(reference, shard, rank, size), rank)


def _whole_sums(local: Tensor, reference: Tensor) -> GapSums | str:
    if tuple(local.shape) != tuple(reference.shape):
        return f"shape {tuple(local.shape)} where the model gives {tuple(reference.shape)}"
    return GapSums().add(local, reference)


def shard_differences(
    local: dict[str, Tensor], reference: dict[str, Tensor | RankPart] | None, prefix: str, tp: Any | None
) -> dict[str, Difference] | None:
    """Each of ``local``'s gradients (by name relative to the piece at ``prefix``, this rank's
    shape) against ``reference``'s (full shape, or this rank's part: :func:`keep_rank_parts`),
    over the tp ranks. ``reference`` is emptied
    as it goes (each full gradient freed once compared). ``reference`` None: this rank could
    not run the reference piece; then every rank gets None (so all skip the piece alike).

    A collective over tp (two small all-reduces): every rank holding the piece calls it in
    the same order."""
    names = list(local)
    measured: dict[str, GapSums | str] = {}
    for name in names:
        if reference is None:
            break
        full_name = f"{prefix}.{name}" if prefix else name
        ref = reference.pop(name)
        if not isinstance(ref, RankPart) and tp is not None and tp.is_sharded(full_name):
            ref = rank_part(ref, tp.shards[full_name], tp.rank, tp.size)  # not cut by keep_rank_parts
        if isinstance(ref, RankPart):
            measured[name] = part_sums(local[name], ref, tp.rank)
        else:
            measured[name] = _whole_sums(local[name], ref)
        del ref
    distributed = tp is not None and tp.size > 1
    cut = [n for n in names if distributed and tp.is_sharded(f"{prefix}.{n}" if prefix else n)]
    if cut:  # the cut parameters' sums over the tp ranks: the full tensor's sums
        sums = torch.zeros(len(cut), 2, dtype=torch.float64)
        for i, name in enumerate(cut):
            m = measured.get(name)
            if isinstance(m, GapSums):
                sums[i] = torch.tensor([m.gap_sq, m.reference_sq])
        sums = sums.to(tp.device)
        dist.all_reduce(sums, group=tp.group)
        for i, name in enumerate(cut):
            m = measured.get(name)
            if isinstance(m, GapSums):
                m.gap_sq, m.reference_sq = float(sums[i, 0]), float(sums[i, 1])
    results = {n: _difference(measured.get(n)) for n in names}
    # The worst rank's numbers (a cut parameter's relative error is already every rank's), the
    # reason a rank could not measure, and whether every rank ran the reference.
    worst = torch.tensor([[_finite(d.relative), d.max_abs, _reason(measured.get(n))] for n, d in results.items()]
                         + [[0.0, 0.0, float(reference is None)]], dtype=torch.float64)  # fmt: skip
    if distributed:
        worst = worst.to(tp.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=tp.group)
        worst = worst.cpu()
    if worst[-1, 2] > 0:
        return None
    out = {}
    for i, name in enumerate(names):
        relative, max_abs, reason = (float(v) for v in worst[i])
        mine = results[name]
        if mine.note:
            out[name] = mine
        elif reason == _SHAPE:
            out[name] = Difference(math.inf, math.inf, "shapes do not correspond on another tp rank")
        elif reason == _NON_FINITE:
            out[name] = Difference(math.inf, math.inf, "non-finite values where the model gives finite ones")
        else:
            out[name] = Difference(max_abs, relative)
    return out


def _difference(measured: GapSums | str | None) -> Difference:
    if measured is None:
        return Difference(math.inf, math.inf, "not measured")
    if isinstance(measured, str):
        return Difference(math.inf, math.inf, measured)
    return measured.result()


def _reason(measured: GapSums | str | None) -> float:
    if isinstance(measured, str):
        return float(_SHAPE)
    if isinstance(measured, GapSums) and measured.non_finite:
        return float(_NON_FINITE)
    return float(_NONE)


def _finite(x: float) -> float:
    return math.inf if math.isnan(x) else x  # NaN never wins a MAX: count it as the worst
