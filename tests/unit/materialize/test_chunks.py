"""A recorded tensor's region computed in row chunks equals the same region of the whole tensor,
bit for bit, and the generator ends where the whole draw leaves it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_5d.materialize import InitLog, Replay, recording
from lightning_5d.materialize.apply import capture, materialize
from lightning_5d.materialize.chunks import Step, fill_region, plan_steps, run_chunks
from lightning_5d.materialize.record import Ref
from lightning_5d.parallel.regions import Region, chunk_ranges

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NUMELS = [16, 17, 33, 100, 4099, 64 * 37 + 5]  # numel % 16: 0, 1, 1, 4, 3, 5


def _advanced_generator(explicit: bool) -> torch.Generator | None:
    """A generator part-way through its stream (and with a cached normal sample: a serial draw)."""
    g = torch.Generator().manual_seed(3) if explicit else None
    if g is None:
        torch.manual_seed(3)
    torch.empty(5).normal_(generator=g)  # < 16 elements: the serial path, which caches a sample
    torch.empty(7, dtype=torch.float64).uniform_(generator=g)
    return g


def _state(g: torch.Generator | None) -> torch.Tensor:
    return g.get_state() if g is not None else torch.get_rng_state()


def _draw_in_pieces(func, numel, dtype, cuts, g, **kw) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype)
    bounds = [0, *cuts, numel]
    for a, b in zip(bounds[:-1], bounds[1:]):
        func(out[a:b], **kw, generator=g)
    return out


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_in_chunks_of_sixteen_is_the_whole_draw(dtype, explicit):
    for numel in NUMELS:
        for step in (16, 48, 80):
            cuts = list(range(step, numel, step))
            if cuts and numel - cuts[-1] < 16:  # the last chunk holds >= 16 (the tail's redraw)
                cuts.pop()
            g = _advanced_generator(explicit)
            whole = torch.empty(numel, dtype=dtype).normal_(0.5, 2.0, generator=g)
            after_whole = _state(g)
            g = _advanced_generator(explicit)
            pieces = _draw_in_pieces(torch.Tensor.normal_, numel, dtype, cuts, g, mean=0.5, std=2.0)
            assert torch.equal(whole, pieces), (numel, step)
            assert torch.equal(_state(g), after_whole), (numel, step)


@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_split_off_sixteen_is_not_the_whole_draw(dtype):
    """The proof's precondition matters: a cut inside a group of 16 changes the values."""
    g = torch.Generator().manual_seed(0)
    whole = torch.empty(64, dtype=dtype).normal_(generator=g)
    g = torch.Generator().manual_seed(0)
    assert not torch.equal(whole, _draw_in_pieces(torch.Tensor.normal_, 64, dtype, [24], g))


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_in_any_pieces_is_the_whole_draw(dtype, explicit):
    for numel in NUMELS:
        for cuts in ([1], [7, 13, 29], list(range(5, numel, 11))):
            cuts = [c for c in cuts if c < numel]
            g = _advanced_generator(explicit)
            whole = torch.empty(numel, dtype=dtype).uniform_(-0.3, 0.7, generator=g)
            after_whole = _state(g)
            g = _advanced_generator(explicit)
            pieces = _draw_in_pieces(torch.Tensor.uniform_, numel, dtype, cuts, g, **{"from": -0.3, "to": 0.7})
            assert torch.equal(whole, pieces)
            assert torch.equal(_state(g), after_whole)


class Inits(nn.Module):
    """Big-enough tensors with the init styles the chunked replay accepts, and some it must refuse."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.emb = nn.Embedding(203, 24, padding_idx=57)  # normal_ + the padding row zeroed
        self.lin = nn.Linear(40, 77)  # kaiming_uniform_ (bound from the fan) + bias uniform_
        self.xu = nn.Parameter(torch.empty(91, 13))
        nn.init.xavier_uniform_(self.xu)
        self.xn = nn.Parameter(torch.empty(37, 13))  # 481 elements: numel % 16 != 0
        nn.init.xavier_normal_(self.xn, generator=gen)
        self.ku = nn.Parameter(torch.empty(64, 3, 5))
        nn.init.kaiming_normal_(self.ku, mode="fan_out")
        self.ones = nn.Parameter(torch.ones(300))
        self.full = nn.Parameter(torch.full((50, 7), 0.25))
        self.consts = nn.Parameter(torch.empty(70, 9))
        nn.init.constant_(self.consts, 3.0)
        self.consts.data[5:9, 2:4].zero_()  # a partial view, across chunk boundaries
        self.scaled = nn.Parameter(torch.empty(129, 11))
        self.scaled.data.normal_(0.0, 1.0).mul_(0.02).add_(0.5).clamp_(0.47, 0.53)
        self.gen = nn.Parameter(torch.empty(33, 17))
        nn.init.uniform_(self.gen, -1.0, 1.0, generator=gen)
        self.later = nn.Parameter(torch.empty(45, 6))
        nn.init.normal_(self.later)  # drawn after the explicit generator's draws
        # Not chunkable: a random factory, data-dependent redraws, a copy from another tensor.
        self.randn = nn.Parameter(torch.randn(60, 8))
        self.trunc = nn.Parameter(torch.empty(60, 8))
        nn.init.trunc_normal_(self.trunc, std=0.02)
        self.copied = nn.Parameter(torch.empty(60, 8))
        self.copied.data.copy_(self.ones.data[:240].reshape(60, 4).repeat(1, 2))


CHUNKABLE = {"emb.weight", "lin.weight", "lin.bias", "xu", "xn", "ku", "ones", "full", "consts", "scaled", "gen",
             "later"}  # fmt: skip


def _recorded() -> tuple[nn.Module, InitLog, dict[str, Ref]]:
    log = InitLog()
    torch.manual_seed(11)
    with recording(log):
        model = Inits(torch.Generator().manual_seed(5))
    return model, log, capture(model, log)


def _regions(shape: tuple[int, ...]) -> list[Region]:
    whole = Region.whole(shape)
    out = [whole]
    for rank in range(3):
        out.append(whole.select(0, chunk_ranges(shape[0], 3, rank)))  # FSDP Shard(0) / a column cut
        if len(shape) > 1:
            cols = whole.select(1, chunk_ranges(shape[1], 2, rank % 2, (shape[1] // 2, shape[1] - shape[1] // 2)))
            out.append(cols)  # a row cut of fused segments
            out.append(cols.select(0, chunk_ranges(shape[0], 3, rank)))  # then FSDP's rows of it
    return out


def test_chunked_regions_equal_the_whole_tensor():
    _model, log, refs = _recorded()
    replay = Replay(log)
    for name, ref in refs.items():
        whole = replay.value(ref)
        start = replay.start(ref.key)
        for chunk_bytes in (4, 1000):  # one aligned step of rows per chunk; a few steps
            for region in _regions(tuple(ref.size)):
                out = torch.full(region.local_shape, float("nan"), dtype=ref.dtype)
                done = fill_region(log, ref, start, region, out, chunk_bytes)
                assert done == (name in CHUNKABLE), name
                if not done:
                    assert out.isnan().all(), name  # untouched: the caller recomputes it whole
                    continue
                expected = torch.empty(region.local_shape, dtype=ref.dtype)
                for full_idx, local_idx in region.blocks():
                    expected[local_idx] = whole[full_idx]
                assert torch.equal(out, expected), (name, chunk_bytes, region)


def test_the_replayed_draw_leaves_the_generator_where_the_whole_draw_does():
    _model, log, refs = _recorded()
    ref = refs["emb.weight"]
    start = Replay(log).start(ref.key)
    steps = plan_steps(log, ref, start)
    draw = next(s for s in steps if s.kind == "draw")
    torch.set_rng_state(draw.rng)
    torch.empty(ref.size).normal_()
    after_whole = torch.get_rng_state()
    ranges = [(a, min(a + 16, ref.size[0])) for a in range(0, ref.size[0], 16)]
    run_chunks(ref, steps, ranges, lambda *_: None)
    assert torch.equal(draw.rng, after_whole)


def test_steps_carry_the_full_shape_numbers():
    """kaiming_uniform_'s bound comes from the full tensor's fan, not a chunk's."""
    _model, log, refs = _recorded()
    ref = refs["lin.weight"]
    steps = plan_steps(log, ref, Replay(log).start(ref.key))
    draw = next(s for s in steps if s.kind == "draw")
    assert draw.args == pytest.approx((-1 / math.sqrt(40), 1 / math.sqrt(40)))
    assert isinstance(draw, Step)


class _Columns:
    """A tp-like split: chunk ``rank`` of dim ``dim`` (regions and full tensors cut alike)."""

    def __init__(self, dim: int, rank: int, size: int) -> None:
        self.dim, self.rank, self.size = dim, rank, size

    def local_region(self, name: str, region: Region) -> Region:
        if len(region.shape) <= self.dim:
            return region
        return region.select(self.dim, chunk_ranges(region.local_shape[self.dim], self.size, self.rank))

    def local_state(self, state: dict) -> dict:
        out = {}
        for k, v in state.items():
            out[k] = v if v.dim() <= self.dim else v.chunk(self.size, dim=self.dim)[self.rank].clone()
        return out

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() <= self.dim else t.chunk(self.size, dim=self.dim)[self.rank]


@pytest.mark.parametrize("dim", [0, 1])
def test_materialize_in_chunks_equals_the_eager_build_under_a_cut(dim):
    torch.manual_seed(11)
    eager = Inits(torch.Generator().manual_seed(5))
    split = _Columns(dim, 1, 2)
    log = InitLog()
    torch.manual_seed(11)
    with recording(log):
        model = Inits(torch.Generator().manual_seed(5))
    refs = capture(model, log)
    for name, p in list(model.named_parameters()):  # the cut a dimension would make, still on meta
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        owner._parameters[name.rpartition(".")[2]] = nn.Parameter(split.cut(p).clone())
    materialize(model, log, refs, torch.device("cpu"), [split], chunk_bytes=256)
    for name, p in model.named_parameters():
        assert torch.equal(p, split.cut(dict(eager.named_parameters())[name])), name


def _row_region(shape: tuple[int, ...], a: int, b: int) -> Region:
    return Region(shape, (((a, b),), *(((0, s),) for s in shape[1:])))


def test_whole_rows_are_computed_in_the_shard_itself():
    """FSDP2's rows on 64-element bounds: the draws before them go through the shard's own memory,
    those after are skipped, and the values are still the whole tensor's rows."""
    from lightning_5d.materialize.chunks import fill_rows_in_place

    _model, log, refs = _recorded()
    replay = Replay(log)
    cases = {"emb.weight": [(0, 64), (64, 136), (136, 203)], "lin.weight": [(0, 8), (8, 40), (40, 77)],
             "scaled": [(0, 64), (64, 129)], "ku": [(0, 64)]}  # fmt: skip
    for name, bounds in cases.items():
        ref = refs[name]
        whole = replay.value(ref)
        steps = lambda: plan_steps(log, ref, replay.start(ref.key))  # noqa: E731 (fresh generator states each time)
        for a, b in bounds:
            region = _row_region(tuple(ref.size), a, b)
            out = torch.full(region.local_shape, float("nan"), dtype=ref.dtype)
            assert fill_rows_in_place(ref, steps(), region, out), (name, a, b)
            assert torch.equal(out, whole[a:b]), (name, a, b)
    # Bounds off the 64-element grid (emb rows are 24 elements) go by chunks, untouched here.
    ref = refs["emb.weight"]
    out = torch.full((68, 24), float("nan"))
    assert not fill_rows_in_place(ref, plan_steps(log, ref, replay.start(ref.key)), _row_region((203, 24), 68, 136), out)
    assert out.isnan().all()


def test_materialize_drops_the_record_as_it_fills():
    """Every recorded call is forgotten once the tensors needing it are filled (a copy's source
    included: 'copied' reads 'ones', filled in either order)."""
    model, log, refs = _recorded()
    materialize(model, log, refs, torch.device("cpu"), [], chunk_bytes=256)
    assert all(op is None for op in log.ops) and not log.history
