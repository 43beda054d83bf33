"""A recorded tensor's value computed in row chunks, keeping only this rank's region of it.

:class:`~lightning_5d.materialize.replay.Replay` recomputes a tensor at its full shape; for the
32000 x 1536 embedding of a 0.5 B model that is 188 MiB on every rank, above the rank's share.
Here the storage's recorded history is first *lowered*: each recorded call (``nn.init.*``,
``Tensor.normal_``, a factory) is run once more on a meta stand-in of the storage under a
dispatch mode that notes the aten calls it makes. That gives the numbers a call derives from
the full shape (``kaiming_uniform_``'s bound from the fan) without any memory. The history is
chunkable only if every aten call is one of:

* a constant factory creating the storage (``zeros`` / ``ones`` / ``full`` / ``empty``, the last
  replayed as zeros, as :class:`Replay` does);
* a draw over the whole storage, contiguously (``uniform_`` / ``normal_``), at most one per
  recorded call; its generator is restored once to the recorded state and carried from chunk
  to chunk (the CPU kernels' draw order, below, makes the chunks' draws the full draw's);
* a deterministic element-wise in-place op (fill, zero, scale, shift, clamp) on any view of the
  storage (a padding row's ``zero_``): applied to the part of the view inside each chunk.

Anything else (a copy from another tensor, ``trunc_normal_``'s data-dependent redraws,
``orthogonal_``'s QR, a call that returns early on meta) is not chunkable: :func:`fill_region`
returns False and the caller recomputes the whole tensor.

The CPU kernels' draw order (checked by tests/unit/materialize/test_chunks.py over shapes,
dtypes, chunk sizes and generators):

* ``uniform_``: one draw per element, in storage order (``cpu_serial_kernel``): any split is exact;
* ``normal_`` on >= 16 contiguous elements: uniforms for every element first, then Box-Muller in
  groups of 16 from the start, and when ``numel % 16 != 0`` 16 more uniforms overwrite and
  transform the last 16 elements. Chunks that start at multiples of 16 and are each >= 16 long
  reproduce it: every group lies in one chunk, and the last chunk (same length mod 16) redraws
  the same tail from the same generator position.

Chunk boundaries are multiples of 64 elements (16 for ``normal_``, 64 so vectorized element-wise
kernels split a chunk where they split the whole tensor), in whole rows of dim 0.

Memory: the rank's region (already allocated); plus one chunk (``chunk_bytes``, rounded to rows)
unless the region is a contiguous block of whole rows (FSDP2's shard alone), computed in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from lightning_5d.materialize.draws import CHUNK_BYTES, DRAWS, AtenCalls
from lightning_5d.materialize.record import EMPTY_CREATIONS, InitLog, Op, Ref
from lightning_5d.materialize.trees import leaves, map_leaves
from lightning_5d.parallel.regions import Region

_ALIGN = 64  # elements; a multiple of normal_'s group of 16 and of twice the widest float vector

_MARKER_SEED = 0x5EED_0F_C4A7  # any seed; only compared with itself
aten = torch.ops.aten
_CONSTANT_FACTORIES = {aten.zeros.default: 0.0, aten.ones.default: 1.0, aten.empty.memory_format: 0.0,
                       aten.empty_strided.default: 0.0}  # fmt: skip
_ELEMENTWISE = {
    aten.fill_.Scalar, aten.zero_.default, aten.mul_.Scalar, aten.mul_.Tensor, aten.div_.Scalar, aten.div_.Tensor,
    aten.add_.Scalar, aten.add_.Tensor, aten.sub_.Scalar, aten.sub_.Tensor, aten.clamp_.default,
    aten.clamp_min_.default, aten.clamp_max_.default, aten.neg_.default,
}  # fmt: skip
# Calls that only make views (no write, no read of values): the write that follows names its view.
_VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten.select.int, aten.slice.Tensor,
          aten.t.default, aten.transpose.int, aten.as_strided.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.expand.default, aten._reshape_alias.default}  # fmt: skip


@dataclass(frozen=True)
class Geometry:
    """A view of the storage, in elements of the ref's dtype."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Step:
    """One aten call of the lowered history, replayed on each chunk in order."""

    kind: str  # "constant" | "draw" | "elementwise"
    func: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    value: float = 0.0  # kind "constant"
    view: Geometry | None = None  # kind "elementwise"
    rng: Tensor | None = None  # kind "draw", global generator: its state, carried from chunk to chunk
    generator: torch.Generator | None = None  # kind "draw", an explicit generator (restored once)


class _NotChunkable(Exception):
    pass


def plan_steps(log: InitLog, ref: Ref, start: int) -> list[Step] | None:
    """The chunkable steps that rebuild ``ref``'s storage from call ``start`` on, or None."""
    key, nbytes = ref.key, log.nbytes[ref.key]
    if not ref.size or not ref.covers(nbytes) or ref.size[0] == 0:
        return None
    numel = nbytes // ref.dtype.itemsize
    history = [i for i in log.history.get(key, []) if i >= start]
    steps: list[Step] = []
    try:
        for index in history:
            op = log.ops[index]
            if index == start and key in op.creates and op.name in EMPTY_CREATIONS:
                steps.append(Step("constant", value=0.0))  # as Replay: zeros make any gap deterministic
                continue
            steps.extend(_lower(op, ref, numel, creates=index == start and key in op.creates))
    except _NotChunkable:
        return None
    return steps


def _lower(op: Op, ref: Ref, numel: int, creates: bool) -> list[Step]:
    """Run ``op`` on a meta stand-in of the storage; its aten calls as steps (or _NotChunkable)."""
    storage = torch.empty(numel, dtype=ref.dtype, device="meta").untyped_storage()
    # Stands for the op's explicit generator in the captured calls; the dispatcher hands a new
    # Python object for the same generator, so it is recognized by its seed.
    marker = torch.Generator().manual_seed(_MARKER_SEED)

    def stand_in(x: Any) -> Any:
        if isinstance(x, Ref):
            if x.key != ref.key or x.dtype != ref.dtype:
                raise _NotChunkable  # reads another storage, or reinterprets this one
            return torch.empty(0, dtype=x.dtype, device="meta").set_(storage, x.offset, x.size, x.stride)
        if isinstance(x, torch.Generator):
            if op.generators is None or id(x) not in op.generators:
                raise _NotChunkable
            return marker
        return x

    args, kwargs = map_leaves(stand_in, op.args), map_leaves(stand_in, op.kwargs)
    if op.factory:
        kwargs["device"] = torch.device("meta")
    calls = AtenCalls()
    try:
        with torch.no_grad(), calls:
            result = op.func(*args, **kwargs)
    except _NotChunkable:
        raise
    except Exception as err:  # a call meta cannot run (reads values, asks for data): not chunkable
        raise _NotChunkable from err
    if op.generators is not None and len(op.generators) > 1:
        raise _NotChunkable
    explicit = None
    for state in (op.generators or {}).values():  # restored once: the chunks' draws continue its stream
        explicit = torch.Generator()
        explicit.set_state(state)
    steps: list[Step] = []
    draws = 0
    for func, cargs, ckwargs, out in calls.calls:
        if func in _VIEWS:
            continue
        if creates and (func in _CONSTANT_FACTORIES or func is aten.full.default):
            steps.append(_factory(func, cargs, ckwargs, out, ref, numel))
            continue
        target = cargs[0] if cargs else None
        if not isinstance(target, Tensor) or not target.is_meta or target.untyped_storage()._cdata != storage._cdata:
            raise _NotChunkable
        if target.dtype != ref.dtype:
            raise _NotChunkable
        view = Geometry(tuple(target.shape), tuple(target.stride()), target.storage_offset())
        rest = (tuple(cargs[1:]), dict(ckwargs))
        if func in DRAWS:
            draws += 1
            if draws > 1 or not _whole(view, numel) or not target.is_floating_point():
                raise _NotChunkable  # a second draw would start where the first ends, after the whole tensor
            gen = rest[1].pop("generator", None)
            if gen is not None and (not op.generators or gen.initial_seed() != _MARKER_SEED):
                raise _NotChunkable
            if gen is None and op.rng is None:
                raise _NotChunkable  # a draw the recorder did not see (no state to start from)
            if _tensor_in(rest):
                raise _NotChunkable
            steps.append(Step("draw", func, *rest, rng=None if gen is not None else op.rng.clone(),
                              generator=explicit if gen is not None else None))  # fmt: skip
        elif func in _ELEMENTWISE:
            if func in (aten.add_.Tensor, aten.sub_.Tensor, aten.add_.Scalar, aten.sub_.Scalar):
                if rest[1].get("alpha", 1) != 1:
                    raise _NotChunkable  # a fused multiply-add may round differently in vector and scalar loops
            if _tensor_in(rest) or any(s > 1 and st <= 0 for s, st in zip(view.size, view.stride)):
                raise _NotChunkable
            steps.append(Step("elementwise", func, *rest, view=view))
        else:
            raise _NotChunkable
    if not steps:
        # It wrote (or drew) without any aten call on meta: e.g. an init that returns early on meta.
        raise _NotChunkable
    if creates and not any(s.kind == "constant" for s in steps[:1]):
        raise _NotChunkable
    del result
    return steps


def _factory(func: Any, args: tuple, kwargs: dict, out: Any, ref: Ref, numel: int) -> Step:
    if not isinstance(out, Tensor) or out.dtype != ref.dtype or out.numel() != numel:
        raise _NotChunkable
    if func is aten.full.default:
        value = args[1]
        if isinstance(value, Tensor) or isinstance(value, complex):
            raise _NotChunkable
        return Step("constant", value=float(value) if ref.dtype.is_floating_point else int(value))
    return Step("constant", value=_CONSTANT_FACTORIES[func])


def _tensor_in(rest: tuple[tuple, dict]) -> bool:
    flat = leaves(rest)
    return any(isinstance(x, Tensor) for x in flat)


def _whole(view: Geometry, numel: int) -> bool:
    if view.offset != 0 or math.prod(view.size) != numel:
        return False
    expected = 1
    for s, st in zip(reversed(view.size), reversed(view.stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def chunk_rows(ref: Ref, steps: list[Step], chunk_bytes: int) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of dim 0 covering the tensor, each about ``chunk_bytes``."""
    rows = ref.size[0]
    row = math.prod(ref.size[1:])
    align = _ALIGN // math.gcd(row, _ALIGN) if row else 1  # rows per aligned step
    per = max(align, (chunk_bytes // max(row * ref.dtype.itemsize, 1)) // align * align)
    bounds = list(range(0, rows, per)) + [rows]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    # normal_ needs its last chunk >= 16 elements (its tail redraw covers the last 16).
    if len(ranges) > 1 and (ranges[-1][1] - ranges[-1][0]) * row < 16:
        ranges[-2:] = [(ranges[-2][0], rows)]
    return ranges


def fill_region(
    log: InitLog, ref: Ref, start: int, region: Region, out: Tensor, chunk_bytes: int = CHUNK_BYTES
) -> bool:
    """Write ``region`` of ``ref``'s recorded value into ``out`` (shape ``region.local_shape``), one
    row chunk at a time; False (``out`` untouched) if the history is not provably chunkable.

    Rows ``[a, b)`` whole in every other dimension (FSDP2's dim-0 shard) held in a contiguous
    ``out`` are computed in ``out`` itself (:func:`fill_rows_in_place`): no chunk buffer at all."""
    steps = plan_steps(log, ref, start)
    if steps is None:
        return False
    numel = math.prod(ref.size)
    if any(s.func is aten.normal_.default for s in steps) and numel < 16:
        return False  # below 16 elements normal_ takes its serial path (a cached second sample)
    if region.numel() == 0:
        return True  # nothing held here (an uneven shard's last rank)
    if fill_rows_in_place(ref, steps, region, out):
        return True
    ranges = chunk_rows(ref, steps, chunk_bytes)
    last = max(b for a, b in region.ranges[0])
    # The chunks after the region's last row would only advance a generator no one reads again
    # (each draw restores its recorded state, on a generator of its own).
    ranges = [(r0, r1) for r0, r1 in ranges if r0 < last]
    run_chunks(ref, steps, ranges, lambda r0, r1, chunk: _keep(region, r0, r1, chunk, out))
    return True


def _row_block(ref: Ref, region: Region, out: Tensor) -> tuple[int, int] | None:
    """``(a, b)`` when ``region`` is rows ``[a, b)`` of dim 0, whole in every other dim, and ``out``
    holds them contiguously; else None."""
    if len(region.ranges[0]) != 1 or not out.is_contiguous() or tuple(out.shape) != region.local_shape:
        return None
    if any(rs != ((0, size),) for rs, size in zip(region.ranges[1:], ref.size[1:])):
        return None
    return region.ranges[0][0]


def fill_rows_in_place(ref: Ref, steps: list[Step], region: Region, out: Tensor) -> bool:
    """Compute rows ``[a, b)`` of the value directly in ``out``; False if the region is not such a
    block or its bounds do not fall on an aligned element (the caller then goes by chunks).

    The rows before ``a`` are drawn too, so the generator reaches ``a`` where the full draw does
    (their numbers are discarded): into ``out`` itself, in pieces of at most its size, before its
    own rows are computed. The rows after ``b`` are not drawn (see :func:`fill_region`). Bounds
    on multiples of 64 elements keep the draws the full draw's (module docstring); the region
    must hold >= 64 elements for its own draw and for the pieces before it."""
    block = _row_block(ref, region, out)
    if block is None:
        return False
    a, b = block
    row = math.prod(ref.size[1:])
    e0, e1 = a * row, b * row
    if e0 % _ALIGN or (b < ref.size[0] and e1 % _ALIGN) or e1 - e0 < _ALIGN:
        return False
    flat = out.view(-1)
    draws = [s for s in steps if s.kind == "draw"]
    if draws:
        piece = (e1 - e0) // _ALIGN * _ALIGN
        with torch.no_grad():
            for p0 in range(0, e0, piece):
                p1 = min(p0 + piece, e0)  # a multiple of 64: e0 and piece are
                _compute(flat[: p1 - p0], p0, p1, draws)
    with torch.no_grad():
        _compute(flat, e0, e1, steps)
    return True


def run_chunks(
    ref: Ref, steps: list[Step], ranges: list[tuple[int, int]], keep: Callable[[int, int, Tensor], None]
) -> None:
    """Compute each row range of the value in turn and hand it to ``keep(r0, r1, chunk)``.

    Every range given is drawn, kept or not, so each draw reaches the next range where the full
    draw does (the caller may leave out the ranges after the last one it keeps: each draw's
    generator is its own, :func:`fill_region`). The global generator's state is restored before
    and saved after each draw, so several draws interleave without disturbing each other.
    """
    row = math.prod(ref.size[1:])
    for r0, r1 in ranges:
        e0, e1 = r0 * row, r1 * row
        buf = torch.empty(e1 - e0, dtype=ref.dtype)
        with torch.no_grad():
            _compute(buf, e0, e1, steps)
        keep(r0, r1, buf.view(r1 - r0, *ref.size[1:]))
        del buf


def _compute(buf: Tensor, e0: int, e1: int, steps: list[Step]) -> None:
    """Storage elements ``[e0, e1)`` of the value into ``buf`` (1-D, ``e1 - e0`` elements): each
    step in turn; a draw continues its generator from where the previous range left it."""
    for step in steps:
        if step.kind == "constant":
            buf.fill_(step.value)
        elif step.kind == "draw":
            if step.generator is not None:
                step.func(buf, *step.args, **step.kwargs, generator=step.generator)
            else:
                torch.set_rng_state(step.rng)
                step.func(buf, *step.args, **step.kwargs)
                step.rng = torch.get_rng_state()
        else:
            assert step.view is not None
            _on_window(buf, e0, e1, step.view, lambda v, s=step: s.func(v, *s.args, **s.kwargs))


def _on_window(buf: Tensor, e0: int, e1: int, view: Geometry, fn: Callable[[Tensor], Any]) -> None:
    """Apply ``fn`` to the elements of ``view`` that lie in storage elements ``[e0, e1)`` (``buf``)."""
    size, stride, offset = view.size, view.stride, view.offset
    if any(s == 0 for s in size):
        return
    extent = sum((s - 1) * st for s, st in zip(size, stride))
    if offset + extent < e0 or offset >= e1:
        return
    if offset >= e0 and offset + extent < e1:
        fn(buf.as_strided(size, stride, offset - e0))
        return
    s0, st0 = size[0], stride[0]
    if s0 == 1:
        _on_window(buf, e0, e1, Geometry(size[1:], stride[1:], offset), fn)
        return
    rest = extent - (s0 - 1) * st0
    first = max(0, -(-(e0 - rest - offset) // st0))  # sub-views that may touch the window
    last = min(s0, (e1 - 1 - offset) // st0 + 1)
    inside_lo = max(first, -(-(e0 - offset) // st0))  # sub-views wholly inside it
    inside_hi = min(last, (e1 - 1 - rest - offset) // st0 + 1)
    if inside_lo < inside_hi:
        fn(buf.as_strided((inside_hi - inside_lo, *size[1:]), stride, offset + inside_lo * st0 - e0))
    else:
        inside_lo = inside_hi = last
    for i in [*range(first, inside_lo), *range(max(inside_hi, inside_lo), last)]:
        _on_window(buf, e0, e1, Geometry(size[1:], stride[1:], offset + i * st0), fn)


def _keep(region: Region, r0: int, r1: int, chunk: Tensor, out: Tensor) -> None:
    """Copy the part of ``region`` in rows ``[r0, r1)`` from ``chunk`` into ``out``."""
    local = 0
    for a, b in region.ranges[0]:
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
            rows = Region(chunk.shape, (((lo - r0, hi - r0),), *region.ranges[1:]))
            for src, dst in rows.blocks():
                dst = (slice(local + lo - a, local + hi - a), *dst[1:])
                out[dst].copy_(chunk[src])
        local += b - a
