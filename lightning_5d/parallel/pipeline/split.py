"""Cutting a model's blocks into pipeline stages.

Stage s holds a contiguous run of blocks; the first stage also holds the embedding, the
last the final norm and the head. Without explicit ``stage_blocks`` the cut minimises the
largest stage's weight (the slowest stage sets the pace of the whole pipeline).
"""

from __future__ import annotations

from typing import Sequence

from lightning_5d.config import LayoutError, StageBalance


def stage_weights(block_params: Sequence[int], head_params: int, balance: StageBalance) -> list[int]:
    """Per-block weights; COST adds the head's matmul to the last block's, so the last stage gets fewer blocks."""
    weights = list(block_params)
    if balance == StageBalance.COST and weights:
        weights[-1] += head_params
    return weights


def split_blocks(weights: Sequence[int], num_stages: int, stage_blocks: Sequence[int] | None = None) -> list[range]:
    """Block index ranges, one per stage, each non-empty."""
    n = len(weights)
    if num_stages > n:
        raise LayoutError(
            f"the model has {n} blocks but the pipeline has {num_stages} stages (pp x virtual_stages); "
            f"every stage needs at least one block: lower pp or virtual_stages so that pp*v <= {n}."
        )
    if stage_blocks is not None:
        if len(stage_blocks) != num_stages or sum(stage_blocks) != n or min(stage_blocks) < 1:
            raise LayoutError(
                f"pipeline.stage_blocks={list(stage_blocks)} must give {num_stages} positive block counts summing to "
                f"the model's {n} blocks."
            )
        counts = list(stage_blocks)
    else:
        counts = _min_max_partition(weights, num_stages)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def _min_max_partition(weights: Sequence[int], k: int) -> list[int]:
    """Counts of k contiguous non-empty parts minimising the largest part's sum.

    Dynamic programme over (parts, prefix); ties go to the most even counts so equal
    blocks split as evenly as possible.
    """
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: (largest part, spread of counts) for the first i blocks in j parts
    best = [[(inf, inf)] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, 0)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for prev in range(j - 1, i):
                if best[j - 1][prev][0] == inf:
                    continue
                part = prefix[i] - prefix[prev]
                size = i - prev
                ideal = n / k
                score = (max(best[j - 1][prev][0], part), best[j - 1][prev][1] + (size - ideal) ** 2)
                if score < best[j][i]:
                    best[j][i], cut[j][i] = score, prev
    counts, i = [], n
    for j in range(k, 0, -1):
        prev = cut[j][i]
        counts.append(i - prev)
        i = prev
    return counts[::-1]
