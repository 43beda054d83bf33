"""The recorder's draws in chunks: the generator ends where the whole-tensor draw leaves it, with
one chunk in memory; calls that are not one whole contiguous uniform_ / normal_ are drawn whole."""

import math

import pytest
import torch
from torch import nn

import lightning_5d.materialize.draws as draws
import lightning_5d.materialize.record as record
from lightning_5d.materialize import InitLog, recording
from lightning_5d.materialize.draws import CHUNK_BYTES, advance, chunk_sizes, observe

CALLS = {
    "uniform_": lambda t: t.uniform_(-2.0, 3.0),
    "normal_": lambda t: t.normal_(0.5, 2.0),
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out"),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "rows_of_it": lambda t: t[3:].normal_(0.0, 0.02),  # a contiguous view: only its elements are drawn
    "randn": lambda t: torch.randn(t.shape, dtype=t.dtype, device=t.device),  # factories: their kernel's draw
    "rand": lambda t: torch.rand(*t.shape, dtype=t.dtype, device=t.device),
    "randn_out": lambda t: torch.randn(t.shape, out=t),  # shows as normal_ on t
}
SHAPES = [(5, 3), (37, 13), (64, 64), (1000, 33)]  # 15 (< 16), 481 and 33,000 (% 16 != 0), 4,096


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_chunked_draw_leaves_the_generator_where_the_whole_draw_does(call, dtype):
    for shape in SHAPES:
        for chunk_bytes in (1, 1000, CHUNK_BYTES):  # one group of 16 per chunk, a few groups, the default
            torch.manual_seed(3)
            call(torch.empty(shape, dtype=dtype))
            expected = torch.get_rng_state()
            torch.manual_seed(3)
            draw = observe(call, (torch.empty(shape, dtype=dtype, device="meta"),), {})
            assert draw is not None and draw.dtype == dtype
            advance(draw, chunk_bytes)
            assert torch.equal(torch.get_rng_state(), expected), (shape, chunk_bytes)


def test_an_explicit_generator_is_the_one_moved_on():
    eager, chunked = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    nn.init.normal_(torch.empty(37, 13), generator=eager)
    before = torch.get_rng_state()
    draw = observe(nn.init.normal_, (torch.empty(37, 13, device="meta"),), {"generator": chunked})
    advance(draw, 64)
    assert torch.equal(chunked.get_state(), eager.get_state())
    assert torch.equal(torch.get_rng_state(), before)


NOT_ONE_WHOLE_DRAW = {
    "trunc_normal_ (returns early on meta)": (nn.init.trunc_normal_, torch.float32),
    "randint factory": (lambda t: torch.randint(0, 5, (64,), device="meta"), torch.float32),
    "integer random_": (lambda t: t.random_(0, 10), torch.int64),
    "bernoulli_": (lambda t: t.bernoulli_(0.5), torch.float32),
    "two draws": (lambda t: (t.uniform_(), t.normal_()), torch.float32),
    "non-contiguous": (lambda t: t.t().uniform_(), torch.float32),
    "no draw": (lambda t: t.fill_(1.0), torch.float32),
    "a draw on another tensor": (lambda t: torch.empty(8).normal_(), torch.float32),
}


def test_a_factory_with_no_device_is_observed_on_the_recording_device():
    generator = torch.Generator().manual_seed(4)
    expected = torch.Generator().manual_seed(4)
    torch.randn(300, 7, generator=expected)
    with torch.device("meta"):  # the recording's context; observe itself runs without torch-function modes
        draw = observe(torch.randn, (300, 7), {"generator": generator})
    advance(draw, 64)
    assert torch.equal(generator.get_state(), expected.get_state())


@pytest.mark.parametrize("call,dtype", NOT_ONE_WHOLE_DRAW.values(), ids=NOT_ONE_WHOLE_DRAW.keys())
def test_anything_but_one_whole_contiguous_uniform_or_normal_is_drawn_whole(call, dtype):
    before = torch.get_rng_state()
    assert observe(call, (torch.empty(64, 32, dtype=dtype, device="meta"),), {}) is None
    assert torch.equal(torch.get_rng_state(), before)  # observing drew nothing, even on a real tensor


def test_empty_tensors_record_as_before():
    """Zero elements: nothing to chunk (drawn whole, which draws nothing); the build still records."""
    assert observe(lambda t: t.normal_(), (torch.empty(0, device="meta"),), {}) is None
    torch.manual_seed(2)
    nn.Linear(4, 0), nn.Embedding(0, 8), torch.randn(1, 0, 8)
    after_eager = torch.rand(3)
    torch.manual_seed(2)
    with recording(InitLog()):
        nn.Linear(4, 0), nn.Embedding(0, 8), torch.randn(1, 0, 8)
    assert torch.equal(torch.rand(3), after_eager)


def test_a_factory_that_lands_on_cpu_under_the_meta_context_draws_once():
    """torch.normal(mean, std, size) is not one of torch.device's factories: under the recording's
    meta context it makes a CPU tensor and draws for real; the recorder must not draw it again."""
    torch.manual_seed(6)
    torch.normal(0.0, 1.0, (40, 8)), nn.Linear(8, 8)
    after_eager = torch.rand(3)
    torch.manual_seed(6)
    with recording(InitLog()):
        real = torch.normal(0.0, 1.0, (40, 8))
        nn.Linear(8, 8)
    assert not real.is_meta
    assert torch.equal(torch.rand(3), after_eager)


def test_chunk_sizes_are_multiples_of_16_but_the_last_which_has_at_least_16():
    for numel in (1, 15, 16, 17, 31, 32, 33, 100, 1000, 1023):
        for per in (16, 32, 48):
            sizes = chunk_sizes(numel, per)
            assert sum(sizes) == numel
            assert all(n == per for n in sizes[:-1])
            assert sizes[-1] <= per + 15 and (sizes[-1] >= 16 or len(sizes) == 1)


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 256)  # 4 MiB, normal_
        self.proj = nn.Linear(256, 2048)  # 2 MiB, kaiming_uniform_
        self.pos = nn.Parameter(torch.randn(1, 512, 256) * 0.02)  # 0.5 MiB, a factory
        self.trunc = nn.Parameter(torch.empty(64, 64))
        nn.init.trunc_normal_(self.trunc, std=0.02)  # no aten draw on meta: drawn whole


def test_recording_holds_one_chunk_where_it_held_the_largest_tensor(monkeypatch):
    asked = {"chunked": [], "whole": []}

    def counting(kind, real):
        def scratch(nbytes):
            asked[kind].append(nbytes)
            return real(nbytes)

        return scratch

    monkeypatch.setattr(draws, "scratch_storage", counting("chunked", draws.scratch_storage))
    monkeypatch.setattr(record, "scratch_storage", counting("whole", record.scratch_storage))
    torch.manual_seed(9)
    Wide()
    after_eager = torch.rand(3)
    torch.manual_seed(9)
    with recording(InitLog()):
        Wide()
    assert torch.equal(torch.rand(3), after_eager)
    assert len(asked["chunked"]) == 4  # emb.weight, proj.weight, proj.bias, pos
    assert max(asked["chunked"]) <= CHUNK_BYTES + 16 * 4
    assert asked["whole"] == [64 * 64 * 4]  # only trunc_normal_, whose draws meta does not show
