"""Regions of a full tensor a rank holds: the same elements the splits' ``local_state`` cuts."""

from types import SimpleNamespace

import pytest
import torch

from lightning_5d.parallel.regions import FlatSlice, Region, chunk_ranges, read_region, splits_region
from lightning_5d.parallel.tensor.sharding import TensorParallel, TensorShard


def fake_tp(shards, rank, size):
    """TensorParallel's checkpoint side without a process group: its shards, rank and size."""
    tp = object.__new__(TensorParallel)
    tp.shards, tp.rank, tp.size = shards, rank, size
    return tp


def gather(full: torch.Tensor, region: Region) -> torch.Tensor:
    out = torch.empty(region.local_shape, dtype=full.dtype)
    read_region(lambda index: full[index], region, out)
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    "shard,shape",
    [
        (TensorShard(0, (32, 8, 8)), (48, 16)),  # fused [q|k|v] with grouped kv, cut per segment
        (TensorShard(0, (24, 24)), (48, 16)),  # [gate|up]
        (TensorShard(1), (16, 48)),  # a row-parallel weight: columns
        (TensorShard(0), (40,)),  # a bias / vocab rows
    ],
)
def test_tensor_parallel_regions_cut_what_take_cuts(shard, shape, size):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    for rank in range(size):
        tp = fake_tp({"w": shard}, rank, size)
        region = splits_region("w", shape, [tp])
        assert torch.equal(gather(full, region), shard.take(full, rank, size)), rank
        assert torch.equal(gather(full, splits_region("other", shape, [tp])), full)  # not cut: whole


def test_a_shard_of_a_fused_piece_composes_in_the_piece_coordinates():
    """FSDP2's dim-0 shard of a tp rank's [q|k|v] piece: rows of the concatenated segment chunks."""
    full = torch.arange(48 * 4, dtype=torch.float32).view(48, 4)
    shard = TensorShard(0, (32, 8, 8))
    piece = shard.take(full, 1, 2)  # rows 16:32, 36:40, 44:48 -> 24 rows
    region = splits_region("w", full.shape, [fake_tp({"w": shard}, 1, 2)])
    for lo, hi in [(0, 12), (12, 24), (14, 20)]:  # the second half spans the q and k segments
        sub = region.select(0, [(lo, hi)])
        assert torch.equal(gather(full, sub), piece[lo:hi])
    assert region.select(0, [(12, 24)]).ranges[0] == ((28, 32), (36, 40), (44, 48))


def test_chunk_ranges_follow_torch_chunk_for_uneven_sizes():
    for n, parts in [(10, 4), (7, 3), (3, 4)]:
        chunks = torch.arange(n).chunk(parts)
        for rank in range(parts):
            got = [i for a, b in chunk_ranges(n, parts, rank) for i in range(a, b)]
            want = chunks[rank].tolist() if rank < len(chunks) else []
            assert got == want


def test_grouped_experts_keep_their_rows():
    from lightning_5d.parallel.expert.moe import ExpertParallel
    from lightning_5d.plan import ExpertsKind

    ep = object.__new__(ExpertParallel)
    layer = SimpleNamespace(path="m.moe", plan=SimpleNamespace(num_experts=4, experts_kind=ExpertsKind.GROUPED),
                            sliced={"w1": 4})  # fmt: skip
    ep.group, ep.layers, ep.ep, ep.rank = object(), [layer], 2, 1
    ep.local_range = lambda n: (2, 4)
    full = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)
    region = splits_region("m.moe.w1", full.shape, [ep])
    assert torch.equal(gather(full, region), full[2:4])
    assert splits_region("m.moe.router.weight", (4, 3), [ep]).local_shape == (4, 3)


@pytest.mark.parametrize("start,length", [(0, 5), (3, 9), (7, 1), (12, 12), (5, 0)])
def test_flat_slices_read_their_covering_rows(start, length):
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    region, offset = FlatSlice(start, length).covering(Region.whole(full.shape))
    rows = gather(full, region)
    assert rows.shape[0] <= -(-length // 4) + 1  # at most one row more than the slice needs
    assert torch.equal(rows.reshape(-1)[offset : offset + length], full.reshape(-1)[start : start + length])


def test_zero_dim_tensors_are_read_whole():
    value = torch.tensor(3.0)
    out = torch.empty(())
    assert read_region(lambda index: value[index], Region.whole(()), out) == 4 and out == 3
