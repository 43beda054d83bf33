"""Every rank's start-up bytes for a layout, grouped into classes of ranks that hold the same.

:func:`startup_classes` cuts each class of ranks once (:mod:`.holdings`), then counts the
state of every rank of it (:mod:`.state`; ZeRO's slices can differ by rank) and groups the
ranks whose bytes agree. Nothing is allocated: the models are built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from lightning_5d.config import Layout, ParallelConfig
from lightning_5d.dryrun.holdings import CutClasses, Part, cut_classes
from lightning_5d.dryrun.state import RankState, StateRules, rank_state, shard_groups
from lightning_5d.dryrun.rank_mesh import RankMesh
from lightning_5d.layout_rules import Combination


@dataclass(frozen=True)
class RankClass:
    """Ranks that hold the same bytes at start-up."""

    ranks: tuple[int, ...]
    coords: dict[str, int]  # the cut class's coordinates (e.g. pp)
    blocks: int
    first: bool  # holds the embedding
    last: bool  # holds the head
    state: RankState


def startup_classes(
    build: Callable[[], nn.Module], config: ParallelConfig, layout: Layout, combination: Combination,
    rules: StateRules, classes: CutClasses = CutClasses.STAGE, plan_needed: bool | None = None,
) -> list[RankClass]:  # fmt: skip
    """``build``: makes the unsplit model (called under ``torch.device("meta")``). ``plan_needed``:
    as :func:`~lightning_5d.dryrun.holdings.cut_classes` takes it (the job's precision decides too)."""
    out: list[RankClass] = []
    for cut in cut_classes(build, config, layout, combination, classes, plan_needed):
        parts = cut.parts()
        groups: dict[tuple, list[int]] = {}
        states: dict[tuple, RankState] = {}
        by_shard: dict[tuple, RankState] = {}
        for rank in cut.ranks:
            shard = shard_groups(layout, RankMesh(layout, rank))
            if shard not in by_shard:
                by_shard[shard] = rank_state(cut.tensors, rules, layout, rank)
            state = by_shard[shard]
            groups.setdefault(state.key(), []).append(rank)
            states[state.key()] = state
        for key, ranks in groups.items():
            out.append(RankClass(tuple(ranks), cut.coords, cut.blocks, Part.EMBEDDING in parts, Part.HEAD in parts,
                                 states[key]))  # fmt: skip
    return sorted(out, key=lambda c: c.ranks[0])


def rank_ranges(ranks: tuple[int, ...], limit: int = 4) -> str:
    """``0-7,16-23`` (the first ``limit`` runs, then how many ranks in all)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:limit])
    return text if len(runs) <= limit else f"{text},... ({len(ranks)} ranks)"
