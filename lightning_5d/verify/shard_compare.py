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
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.verify.compare import Difference, GapSums, row_blocks

# Why a gradient could not be measured (the column reduced by MAX over the tp ranks).
_NONE, _NON_FINITE, _SHAPE = 0, 1, 2


class SpilledSlice:
    """One slice of a reference gradient written to an unlinked temporary file block by block of
    rows (:func:`~.compare.row_blocks`: the blocks the comparison steps through), and read back
    one block at a time: the parallel backward then runs with none of it in memory."""

    def __init__(self, view: Tensor) -> None:
        self.shape, self.dtype = tuple(view.shape), view.dtype
        self._file = tempfile.TemporaryFile(prefix="l5d-verify-")  # unlinked: nothing is left on disk
        self._blocks: list[tuple[int, ...]] = []
        try:
            for block in row_blocks(view):
                data = block.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
                self._file.write(memoryview(data.numpy()))
                self._blocks.append(tuple(block.shape))
            self._file.flush()
        except OSError:
            self._file.close()
            raise
        self.nbytes = self._file.tell()

    def blocks(self) -> Iterator[Tensor]:
        """The slice's blocks of rows, in order, each read into a fresh CPU tensor."""
        self._file.seek(0)
        element = torch.empty((), dtype=self.dtype).element_size()
        for shape in self._blocks:
            raw = torch.empty(math.prod(shape) * element, dtype=torch.uint8)
            self._file.readinto(memoryview(raw.numpy()))
            yield raw.view(self.dtype).reshape(shape)

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class RankPart:
    """The slices of a full reference gradient that this tp rank's shard is compared with, in
    order along the cut dimension: one tensor (the slices copied out into one), or each slice
    spilled to a file (:class:`SpilledSlice`); and the full gradient's shape, for the message."""

    slices: tuple[Tensor | SpilledSlice, ...]
    dim: int
    full_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.slices[0].shape)
        shape[self.dim] = sum(s.shape[self.dim] for s in self.slices)
        return tuple(shape)

    @property
    def spilled(self) -> bool:
        return any(isinstance(s, SpilledSlice) for s in self.slices)


def rank_part(reference: Tensor, shard: Any, rank: int, size: int, spill: bool = False) -> RankPart:
    """This rank's slices of the full ``reference`` as ``shard`` cuts it: copied out into one
    tensor, or with ``spill`` each written to a file straight from its view (no copy of the
    part in memory, next to the full gradient, at any time)."""
    views = shard.slices(reference, rank, size)
    if spill:
        spilled: list[SpilledSlice] = []
        try:
            for view in views:
                spilled.append(SpilledSlice(view))
            return RankPart(tuple(spilled), shard.dim, tuple(reference.shape))
        except OSError:  # no room in the temporary folder (TMPDIR): kept in memory, as without the spill
            for done in spilled:
                done.close()
    return RankPart((torch.cat(views, dim=shard.dim),), shard.dim, tuple(reference.shape))


def keep_rank_parts(
    reference: dict[str, Tensor], prefix: str, tp: Any | None, reference_bytes: int | None = None
) -> None:
    """Replace, in place, each full reference gradient of a parameter tp cut by this rank's
    part of it, freeing the full one before the parallel backward runs: on the 0.5 B model's
    vocabulary-parallel head under tp2 x ZeRO-3 the full 188 MiB gradient was held next to
    the rank's gathered 94 MiB weight and its 94 MiB gradient; the part is 94 MiB.

    ``reference_bytes``: what the reference's backward held (its full gradients and the weights
    it kept). The parallel backward holds the piece's parameters at this rank's shape and their
    gradients; where that and the kept parts would come to more (1.5 x under tp2 for a head
    whose full weight the reference released: 3 x 94 against 188 MiB), the parts are spilled to
    a temporary file instead (:class:`SpilledSlice`), and the check's peak stays the
    reference's: the rank's share plus its largest tensor (rule 2)."""
    if tp is None:
        return
    cut = [n for n in reference if tp.is_sharded(f"{prefix}.{n}" if prefix else n)]
    if not cut:
        return
    parts = sum(reference[n].nbytes // tp.size for n in cut)
    whole = sum(t.nbytes for n, t in reference.items() if n not in cut)
    spill = reference_bytes is not None and 2 * (parts + whole) + parts > reference_bytes
    for name in cut:
        full_name = f"{prefix}.{name}" if prefix else name
        reference[name] = rank_part(reference[name], tp.shards[full_name], tp.rank, tp.size, spill=spill)


def part_sums(local: Tensor, part: RankPart, rank: int) -> GapSums | str:
    """The sums of ``local`` (this rank's shard) against its part of the reference; a note when
    the shapes do not correspond."""
    if tuple(local.shape) != part.shape:
        return (f"shape {tuple(local.shape)} on tp rank {rank} where the model's {part.full_shape}, "
                f"cut by tp, gives {part.shape}")  # fmt: skip
    sums = GapSums()
    pieces = local.split([s.shape[part.dim] for s in part.slices], dim=part.dim)
    for piece, ref in zip(pieces, part.slices):
        if isinstance(ref, SpilledSlice):
            for block, ref_block in zip(row_blocks(piece), ref.blocks()):
                sums.add_block(block, ref_block)
            ref.close()
        else:
            sums.add(piece, ref)
    return sums


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
