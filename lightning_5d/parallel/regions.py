"""Which elements of a full (unsplit) tensor a rank holds, as index ranges, so loading can
read just those from a file instead of the whole tensor.

A :class:`Region` keeps, per dimension, the ranges ``[start, stop)`` of the full tensor whose
concatenation (in order) is the rank's piece along that dimension. Every cut this project
makes is separable that way:

* tensor parallelism (``TensorShard``): along one dim, chunk ``rank`` of each fused segment
  (``[q|k|v]`` gives three ranges, one per segment; a plain or per-group layout one range);
* grouped experts (``ExpertParallel``): rows ``[lo, hi)`` of dim 0;
* an FSDP2 / DTensor shard: a contiguous range of the piece the cuts above left, per dim;
* a ZeRO-1/2 master: a flat range of the flattened piece, not a rectangle; it is read as the
  covering rows of dim 0 (at most one row more on each end) and selected after the read.

Splits compose with :meth:`Region.select`, which takes ranges in the *current piece's*
coordinates, so the order of cuts is the order :func:`local_state` applies them in. A
region yields the rectangles to read (:meth:`Region.blocks`): pairs of the index into the
full tensor and the index into the rank's piece.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Range = tuple[int, int]
Index = tuple[slice, ...]


@dataclass(frozen=True)
class Region:
    """The rank's piece of a full tensor of ``shape``: per dim, the full-tensor ranges it concatenates."""

    shape: tuple[int, ...]
    ranges: tuple[tuple[Range, ...], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Region":
        shape = tuple(int(s) for s in shape)
        return cls(shape, tuple(((0, s),) for s in shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in rs) for rs in self.ranges)

    def numel(self) -> int:
        n = 1
        for s in self.local_shape:
            n *= s
        return n

    def select(self, dim: int, pieces: Sequence[Range]) -> "Region":
        """Keep ``pieces`` (ranges in the current piece's coordinates along ``dim``, concatenated)."""
        out: list[Range] = []
        for lo, hi in pieces:
            offset = 0  # where the current range starts in the piece's coordinates
            for a, b in self.ranges[dim]:
                n = b - a
                start, stop = max(lo, offset), min(hi, offset + n)
                if start < stop:
                    out.append((a + start - offset, a + stop - offset))
                offset += n
        merged: list[Range] = []
        for a, b in out:  # adjacent ranges read as one
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        ranges = list(self.ranges)
        ranges[dim] = tuple(merged)
        return Region(self.shape, tuple(ranges))

    def blocks(self) -> Iterator[tuple[Index, Index]]:
        """(index into the full tensor, index into the rank's piece) of each rectangle to read."""
        per_dim = []
        for rs in self.ranges:
            placed, offset = [], 0
            for a, b in rs:
                placed.append((slice(a, b), slice(offset, offset + b - a)))
                offset += b - a
            per_dim.append(placed)
        for combo in itertools.product(*per_dim):
            yield tuple(c[0] for c in combo), tuple(c[1] for c in combo)


def chunk_ranges(size: int, parts: int, rank: int, segments: Sequence[int] = ()) -> list[Range]:
    """``torch.chunk(parts)[rank]`` of each segment (side by side along a dim of ``size``)."""
    out, offset = [], 0
    for seg in segments or (size,):
        step = -(-seg // parts)
        lo, hi = min(rank * step, seg), min((rank + 1) * step, seg)
        if lo < hi:
            out.append((offset + lo, offset + hi))
        offset += seg
    return out


def dtensor_region(region: Region, target: Tensor) -> Region:
    """Narrow ``region`` (the piece the splits leave) to the local shard of a DTensor target."""
    if not isinstance(target, DTensor):
        return region
    shape, offset = compute_local_shape_and_global_offset(
        region.local_shape, target.device_mesh, target.placements
    )
    for dim, (o, s) in enumerate(zip(offset, shape)):
        if (o, s) != (0, region.local_shape[dim]):
            region = region.select(dim, [(o, o + s)])
    return region


def local_tensor(target: Tensor) -> Tensor:
    return target._local_tensor if isinstance(target, DTensor) else target


@dataclass(frozen=True)
class FlatSlice:
    """A flat range ``[start, start + length)`` of the piece (a ZeRO-1/2 master), read as the
    covering rows of dim 0 and selected from them."""

    start: int
    length: int

    def covering(self, region: Region) -> tuple[Region, int]:
        """(the region of the covering rows, where the slice starts in them flattened)."""
        shape = region.local_shape
        if not shape:
            return region, self.start
        row = max(1, region.numel() // max(shape[0], 1))
        first, last = self.start // row, -(-(self.start + self.length) // row)
        return region.select(0, [(first, last)]), self.start - first * row


def splits_region(name: str, shape: Sequence[int], splits: Sequence) -> Region:
    """The piece of a full tensor ``name`` that the tp / ep / pp splits leave this rank."""
    region = Region.whole(shape)
    for split in splits:
        region = split.local_region(name, region)
    return region


def read_region(
    read: Callable[[Index], Tensor],
    region: Region,
    out: Tensor,
    read_into: Callable[[Index, Tensor], bool] | None = None,
) -> int:
    """Fill ``out`` (the rank's piece, shape ``region.local_shape``) rectangle by rectangle with
    ``read(full index)``; returns the bytes read. One rectangle is in memory at a time, none
    where ``read_into(full index, target)`` fills the target in place (and says so)."""
    if tuple(out.shape) != region.local_shape:
        raise ValueError(f"target shape {tuple(out.shape)} != region {region.local_shape}")
    done = 0
    with torch.no_grad():
        if not region.shape:  # a 0-dim tensor
            value = read(())
            out.copy_(value)
            return value.numel() * value.element_size()
        for full, local in region.blocks():
            target = out[local]
            if read_into is not None and read_into(full, target):
                done += target.numel() * target.element_size()
                continue
            value = read(full)
            target.copy_(value)
            done += value.numel() * value.element_size()
            del value
    return done
