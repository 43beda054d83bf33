"""A pipeline schedule's shape: where its S = p*v stages live, how many microbatches it
takes, and which combinations it accepts. Plain arithmetic on (schedule, p, v, m), no torch:
config validation, the planner, the schedule drawings (``l5d schedule``) and the runtime
(``lightning_5d.parallel.pipeline``) all read it from here, so they agree. Symbols: p
pipeline ranks, v stages per rank (``virtual_stages``), S = p*v stages, m microbatches per
pipeline run.
"""

from __future__ import annotations

from lightning_5d.config import LayoutError, PipelineSchedule

SINGLE_STAGE = frozenset({PipelineSchedule.AFAB, PipelineSchedule.ONE_F_ONE_B})
V_SHAPED = frozenset({PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV})


def stage_ranks(schedule: PipelineSchedule | str, pp: int, v: int) -> list[int]:
    """The pipeline rank of each of the p*v stages.

    Looped placement (stage s on rank s mod p) for everything but the V schedules, whose
    two chunks per rank run down and back up: rank r holds stages r and 2p-1-r, so the
    first and the last stage share rank 0 and the turn at the bottom needs no send.
    """
    schedule = PipelineSchedule(schedule)
    if schedule in V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in range(pp * v)]
    return [s % pp for s in range(pp * v)]


def local_stages(schedule: PipelineSchedule | str, pp: int, v: int, rank: int) -> list[int]:
    return [s for s, r in enumerate(stage_ranks(schedule, pp, v)) if r == rank]


def check_schedule(schedule: PipelineSchedule | str, pp: int, v: int, microbatches: int) -> None:
    """Refuse combinations torch's schedule would reject mid-run, naming a value that works."""
    schedule = PipelineSchedule(schedule)
    name = f"pipeline.schedule={schedule.value}"
    if schedule in SINGLE_STAGE and v != 1:
        raise LayoutError(
            f"{name} runs one stage per rank, but pipeline.virtual_stages={v}; set virtual_stages=1, "
            f"or schedule=interleaved_1f1b to run {v} stages per rank."
        )
    if schedule == PipelineSchedule.INTERLEAVED_1F1B and v < 2:
        raise LayoutError(
            f"{name} needs pipeline.virtual_stages >= 2 (got {v}); with one stage per rank use schedule=1f1b."
        )
    if schedule in V_SHAPED and v != 2:
        raise LayoutError(f"{name} places exactly 2 stages per rank in a V; set pipeline.virtual_stages=2 (got {v}).")
    if microbatches < 1:
        raise LayoutError(f"pipeline.microbatches={microbatches} must be >= 1.")
    if schedule == PipelineSchedule.ONE_F_ONE_B and microbatches < pp:
        raise LayoutError(
            f"{name} needs at least one microbatch per stage (pp={pp}); got pipeline.microbatches={microbatches}. "
            f"Set microbatches >= {pp}, or schedule=afab."
        )
    if schedule == PipelineSchedule.ZERO_BUBBLE or (schedule == PipelineSchedule.INTERLEAVED_1F1B and v > 1):
        # torch runs these in rounds of p microbatches
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            good = sorted({pp * k for k in range(1, 5)} | {k for k in range(1, pp + 1)})
            raise LayoutError(
                f"{name} (virtual_stages={v}) runs microbatches in rounds of pp={pp}: "
                f"pipeline.microbatches={microbatches} is not a multiple of its {rounds} rounds; "
                f"use one of {good}."
            )
    if schedule == PipelineSchedule.DUALPIPEV and microbatches < pp * v:
        raise LayoutError(
            f"{name} needs at least as many microbatches as stages ({pp * v}); got pipeline.microbatches="
            f"{microbatches}. Set microbatches >= {pp * v}."
        )


def check_stage_count(num_blocks: int, pp: int, v: int) -> None:
    if num_blocks < pp * v:
        raise LayoutError(
            f"the model has {num_blocks} blocks but pp={pp} x virtual_stages={v} needs at least {pp * v} "
            f"(one block per stage); lower pp or virtual_stages (pp*v <= {num_blocks})."
        )


def default_microbatches(pp: int, v: int) -> int:
    """2p: keeps the 1F1B bubble (p-1)/(m+p-1) under a third and fits every schedule's rounds."""
    return 2 * pp
