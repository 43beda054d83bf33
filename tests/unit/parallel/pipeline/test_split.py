"""Cutting blocks into stages: balance by parameters or by cost, explicit counts, and the errors."""

import pytest

from lightning_5d.config import LayoutError, StageBalance
from lightning_5d.parallel.pipeline.split import split_blocks, stage_weights


def counts(ranges):
    return [len(r) for r in ranges]


def test_equal_blocks_split_evenly():
    assert counts(split_blocks([10] * 8, 4)) == [2, 2, 2, 2]
    assert counts(split_blocks([10] * 7, 3)) in ([3, 2, 2], [2, 3, 2], [2, 2, 3])


def test_ranges_are_contiguous_and_cover_every_block():
    ranges = split_blocks([5, 1, 1, 1, 9, 2, 2], 3)
    assert [i for r in ranges for i in r] == list(range(7))
    assert all(len(r) >= 1 for r in ranges)


def test_the_heaviest_stage_is_as_light_as_possible():
    weights = [1, 1, 1, 1, 1, 1, 10]
    ranges = split_blocks(weights, 2)
    assert max(sum(weights[i] for i in r) for r in ranges) == 10
    assert counts(ranges) == [6, 1]


def test_cost_balance_gives_the_last_stage_fewer_blocks():
    blocks = [100] * 8
    by_params = split_blocks(stage_weights(blocks, 250, StageBalance.PARAMETERS), 4)
    by_cost = split_blocks(stage_weights(blocks, 250, StageBalance.COST), 4)
    assert counts(by_params) == [2, 2, 2, 2]
    assert counts(by_cost)[-1] == 1 and sum(counts(by_cost)) == 8


def test_explicit_stage_blocks_win():
    assert counts(split_blocks([1] * 6, 3, [1, 2, 3])) == [1, 2, 3]


@pytest.mark.parametrize("stage_blocks", [[1, 2], [2, 2, 3], [0, 3, 3]])
def test_bad_explicit_stage_blocks(stage_blocks):
    with pytest.raises(LayoutError, match="stage_blocks"):
        split_blocks([1] * 6, 3, stage_blocks)


def test_fewer_blocks_than_stages():
    with pytest.raises(LayoutError, match="2 blocks but the pipeline has 4 stages"):
        split_blocks([1, 1], 4)
