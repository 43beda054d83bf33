"""Gradients compared on each rank's shard (single process: the ranks' sums added by hand)."""

import math
import os
import tempfile

import pytest
import torch

from lightning_5d.parallel.tensor.sharding import TensorShard
from lightning_5d.verify import compare
from lightning_5d.verify.compare import GapSums, difference
from lightning_5d.verify.shard_compare import (
    RankPart,
    SpilledSlice,
    keep_rank_parts,
    part_sums,
    rank_part,
    shard_differences,
    shard_sums,
)


def _whole(parallel, reference):
    """The full-shape comparison, computed in one piece (as before the blocks of rows)."""
    gap = (parallel.double() - reference.double())
    return float(gap.abs().max()), float(gap.norm() / reference.double().norm())


def test_blocks_of_rows_add_up_to_the_whole_tensor(monkeypatch):
    monkeypatch.setattr(compare, "_CHUNK", 7)  # several blocks, and rows wider than a block
    torch.manual_seed(0)
    for shape in [(5,), (4, 3), (3, 2, 5), ()]:
        reference = torch.randn(shape)
        parallel = reference + 1e-3 * torch.randn(shape)
        d = difference(parallel, reference)
        max_abs, relative = _whole(parallel, reference)
        assert d.max_abs == pytest.approx(max_abs, rel=1e-12) and d.relative == pytest.approx(relative, rel=1e-9)
    x = torch.randn(2, 4, 3)
    update = 1e-2 * torch.randn(2, 4, 3)
    d = difference(x + 2 * update, x + update, residual_input=x)
    assert d.relative == pytest.approx(1.0, rel=1e-4)  # against the update, not the residual stream


@pytest.mark.parametrize(
    "shard",
    [TensorShard(0), TensorShard(1), TensorShard(0, (8, 4, 4))],  # column, row, fused [q|k|v] column
    ids=["column", "row", "fused"],
)
def test_each_ranks_shard_against_its_slice_sums_to_the_full_comparison(shard):
    torch.manual_seed(0)
    reference = torch.randn(16, 8)
    parallel = reference + 1e-3 * torch.randn(16, 8)
    size = 2
    locals_ = [shard.take(parallel, r, size) for r in range(size)]
    total = GapSums()
    for rank, local in enumerate(locals_):
        sums = shard_sums(local, reference, shard, rank, size)
        total.gap_sq += sums.gap_sq
        total.reference_sq += sums.reference_sq
        total.max_abs = max(total.max_abs, sums.max_abs)
    expected = difference(parallel, reference)
    assert total.result().relative == pytest.approx(expected.relative, rel=1e-9)
    assert total.result().max_abs == pytest.approx(expected.max_abs, rel=1e-12)
    # TensorShard.slices are views of what take copies
    for r in range(size):
        assert torch.equal(torch.cat(shard.slices(parallel, r, size), dim=shard.dim), locals_[r])


def test_a_gradient_cut_in_the_wrong_place_is_far_off():
    """A fused [gate|up] gradient whose rank holds contiguous halves instead of each segment's half."""
    torch.manual_seed(0)
    reference = torch.randn(16, 8)
    fused = TensorShard(0, (8, 8))
    total = GapSums()
    for rank in range(2):
        wrong = TensorShard(0).take(reference, rank, 2)  # the plain cut: rank 0 holds all of gate
        sums = shard_sums(wrong, reference, fused, rank, 2)
        total.gap_sq += sums.gap_sq
        total.reference_sq += sums.reference_sq
    assert total.result().relative > 0.5


def test_a_shard_of_the_wrong_shape_is_named():
    note = shard_sums(torch.zeros(6, 8), torch.zeros(16, 8), TensorShard(0), 1, 2)
    assert isinstance(note, str) and "(6, 8)" in note and "(8, 8)" in note and "tp rank 1" in note


def test_without_tp_each_gradient_is_compared_whole_and_the_reference_freed():
    torch.manual_seed(0)
    ref = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    local = {"w": ref["w"].clone(), "b": ref["b"] / 2}  # a halved gradient: a skipped sum over two ranks
    found = shard_differences(local, ref, "layers.0", None)
    assert ref == {}  # each full reference gradient dropped once compared
    assert found["w"].relative == 0.0
    assert found["b"].relative == pytest.approx(0.5)
    assert math.isinf(shard_differences({"w": torch.zeros(3)}, {"w": torch.zeros(4)}, "", None)["w"].relative)
    assert shard_differences(local, None, "layers.0", None) is None  # the reference could not run


class _OneRankOfTp2:
    """What shard_compare reads of the tp dimension: rank 1 of 2, one parameter cut."""

    rank, size = 1, 2
    shards = {"head.weight": TensorShard(0, (8, 4, 4))}

    def is_sharded(self, name):
        return name in self.shards


def test_the_rank_keeps_only_its_part_of_a_cut_gradient_and_measures_the_same():
    torch.manual_seed(0)
    tp = _OneRankOfTp2()
    full = {"weight": torch.randn(16, 8), "bias": torch.randn(16)}  # bias: held whole
    local = tp.shards["head.weight"].take(full["weight"], 1, 2) + 1e-3
    parts = dict(full)
    keep_rank_parts(parts, "head", tp)
    assert isinstance(parts["weight"], RankPart) and parts["weight"].shape == (8, 8) and not parts["weight"].spilled
    assert parts["bias"] is full["bias"]  # not cut: compared whole
    assert part_sums(local, parts["weight"], 1).result() == shard_sums(local, full["weight"], tp.shards["head.weight"],
                                                                       1, 2).result()  # fmt: skip
    note = part_sums(torch.zeros(6, 8), parts["weight"], 1)
    assert note == "shape (6, 8) on tp rank 1 where the model's (16, 8), cut by tp, gives (8, 8)"


@pytest.mark.parametrize(
    "shard", [TensorShard(0), TensorShard(1), TensorShard(0, (8, 4, 4))], ids=["column", "row", "fused"]
)
def test_a_spilled_part_measures_what_the_part_in_memory_measures(shard, monkeypatch):
    monkeypatch.setattr(compare, "_CHUNK", 5)  # several blocks per slice, rows wider than a block
    torch.manual_seed(0)
    reference = torch.randn(16, 8)
    local = shard.take(reference, 1, 2) + 1e-3 * torch.randn(shard.take(reference, 1, 2).shape)
    local[0, 0] += 0.5  # a large gap in one place: max_abs must find it through the blocks
    kept, spilled = rank_part(reference, shard, 1, 2), rank_part(reference, shard, 1, 2, spill=True)
    assert spilled.spilled and all(isinstance(s, SpilledSlice) for s in spilled.slices)
    assert spilled.shape == kept.shape == tuple(local.shape)
    assert sum(s.nbytes for s in spilled.slices) == local.numel() * 4  # the part, on disk
    a, b = part_sums(local, kept, 1), part_sums(local, spilled, 1)
    assert (a.gap_sq, a.reference_sq, a.max_abs) == pytest.approx((b.gap_sq, b.reference_sq, b.max_abs), rel=1e-12)
    assert not any(name.startswith("l5d-verify-") for name in os.listdir(tempfile.gettempdir()))  # unlinked


def test_parts_are_spilled_where_the_parallel_backward_would_hold_more_than_the_reference_did():
    tp = _OneRankOfTp2()
    full = {"weight": torch.randn(16, 8)}  # 512 B: the rank's part 256 B
    # A head whose full weight the reference released: it held the gradient alone (512 B); the
    # parallel backward holds the rank's weight, its gradient and the part: 3 x 256 > 512.
    released = dict(full)
    keep_rank_parts(released, "head", tp, reference_bytes=512)
    assert released["weight"].spilled
    # A piece whose weights the reference's graph kept: 1,024 B held, 768 B is less.
    kept = dict(full)
    keep_rank_parts(kept, "head", tp, reference_bytes=1024)
    assert not kept["weight"].spilled
    local = tp.shards["head.weight"].take(full["weight"], 1, 2)
    assert part_sums(local, released["weight"], 1).result().relative == 0.0


def test_a_part_that_cannot_be_spilled_is_kept_in_memory(monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", full_disk)
    reference = torch.randn(16, 8)
    part = rank_part(reference, TensorShard(0, (8, 4, 4)), 1, 2, spill=True)
    assert not part.spilled and part.shape == (8, 8)
    local = TensorShard(0, (8, 4, 4)).take(reference, 1, 2)
    assert part_sums(local, part, 1).result().relative == 0.0
