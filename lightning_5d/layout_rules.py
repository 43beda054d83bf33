"""Layout combinations the runtime refuses, decided from the layout alone.

One place for both sides: ``FiveDStrategy`` (and the modules it drives) raise these
messages, and the planner (``lightning_5d.estimate.search``) skips candidates that hit
one, so ``l5d plan`` never ranks a layout ``strategy="5d"`` would refuse. Rules that need
the model's shapes (heads % tp, experts % ep, blocks vs pp*v, ...) are not here: the
runtime checks them against the discovered modules, the planner against its ``ModelSpec``.

Each rule is a function of a :class:`Combination` returning the refusal message or None;
the messages are the runtime's (tests match their wording).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from lightning_5d.config import (
    SPLIT_BACKWARD,
    ContextParallelMode,
    Layout,
    LayoutError,
    ParallelConfig,
    PipelineSchedule,
    ZeroStage,
)
from lightning_5d.parallel.context.hybrid import check_hybrid
from lightning_5d.pipeline_shape import check_schedule, default_microbatches


class Rule(str, Enum):
    """Which refusal; the value is the short name ``l5d plan`` prints when it skips candidates."""

    HSDP_ZERO3_CP = "hsdp_zero3_cp"  # parallel/data/fsdp.py: FSDP2 mesh dp_replicate x (dp_shard*cp) not built yet
    EP_SEQUENCE_PARALLEL = "ep_sequence_parallel"  # strategy.py: tp ranks would route different shards
    ZERO3_SPLIT_BACKWARD = "zero3_split_backward"  # parallel/pipeline/loop.py: FSDP2 hooks vs split B/W
    PIPELINE_SCHEDULE = "pipeline_schedule"  # pipeline_shape.check_schedule: schedule vs v and m
    LOSS_SCALING_PP = "loss_scaling_pp"  # parallel/pipeline/loop.py: GradScaler vs the schedule's own backward
    FP32_ACCUMULATION_PP = "fp32_accumulation_pp"  # strategy.py: schedule sums microbatches in bf16
    FP8_ALL_GATHER_ZERO = "fp8_all_gather_zero"  # strategy.py: only ZeRO-3 all-gathers parameters


@dataclass(frozen=True)
class Combination:
    """A resolved layout plus the options the rules read.

    ``microbatches``: m per pipeline run (None: the runtime's default 2*pp); ``loss_scaling``:
    precision='16-mixed' (a GradScaler); ``fp8_all_gather``: FP8 weights gathered by ZeRO-3.
    """

    layout: Layout
    zero: ZeroStage = ZeroStage.OPTIMIZER
    sequence_parallel: bool = False
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1
    microbatches: int | None = None
    fp32_accumulation: bool = False
    loss_scaling: bool = False
    fp8_all_gather: bool = False


def hsdp_zero3_cp(c: Combination) -> str | None:
    if c.zero == ZeroStage.PARAMETERS and c.layout.dp_replicate > 1 and c.layout.cp > 1:
        return "HSDP (dp_replicate > 1) with ZeRO-3 and cp > 1 is not available yet; use cp=1."
    return None


def ep_sequence_parallel(c: Combination) -> str | None:
    # The runtime reads the flag as given, even at tp=1 (where it is otherwise ineffective).
    if c.layout.ep > 1 and c.sequence_parallel:
        return (
            "ep > 1 with sequence_parallel=true is not supported yet (each tp rank would route a different "
            "sequence shard); use sequence_parallel=false with ep, or ep=1."
        )
    return None


def zero3_split_backward(c: Combination) -> str | None:
    schedule = PipelineSchedule(c.schedule)
    if c.layout.pp > 1 and c.zero == ZeroStage.PARAMETERS and schedule in SPLIT_BACKWARD:
        return (
            f"zero=3 with pipeline.schedule={schedule.value}: the schedule computes weight gradients apart from "
            f"input gradients, which FSDP2's gradient hooks do not follow. Use schedule=1f1b, interleaved_1f1b or "
            f"afab with zero=3, or zero=1/2 with {schedule.value}."
        )
    return None


def pipeline_schedule(c: Combination) -> str | None:
    if c.layout.pp == 1:
        return None
    v = c.virtual_stages
    try:
        check_schedule(c.schedule, c.layout.pp, v, c.microbatches or default_microbatches(c.layout.pp, v))
    except LayoutError as err:
        return str(err)
    return None


def loss_scaling_pp(c: Combination) -> str | None:
    if c.layout.pp > 1 and c.loss_scaling:
        return (
            "precision='16-mixed' scales the loss with a GradScaler, but under pp > 1 the pipeline schedule runs "
            "the backward, so the scale would be undone on unscaled gradients. Use precision='bf16-mixed' or "
            "'32-true' with pp."
        )
    return None


def fp32_accumulation_pp(c: Combination) -> str | None:
    if c.layout.pp > 1 and c.fp32_accumulation:
        return (
            "accumulation_dtype='fp32' with pp > 1: the pipeline schedule sums its microbatches' gradients "
            "itself (in bf16); use accumulation_dtype='bf16' with pp, or pp=1."
        )
    return None


def fp8_all_gather_zero(c: Combination) -> str | None:
    if c.fp8_all_gather and c.zero != ZeroStage.PARAMETERS:
        return (
            f"fp8_all_gather=true all-gathers ZeRO-3 parameters; zero={int(c.zero)} never all-gathers "
            f"parameters before the forward. Use zero=3, or fp8_all_gather=false."
        )
    return None


RULES: dict[Rule, Callable[[Combination], str | None]] = {
    Rule.HSDP_ZERO3_CP: hsdp_zero3_cp,
    Rule.EP_SEQUENCE_PARALLEL: ep_sequence_parallel,
    Rule.ZERO3_SPLIT_BACKWARD: zero3_split_backward,
    Rule.PIPELINE_SCHEDULE: pipeline_schedule,
    Rule.LOSS_SCALING_PP: loss_scaling_pp,
    Rule.FP32_ACCUMULATION_PP: fp32_accumulation_pp,
    Rule.FP8_ALL_GATHER_ZERO: fp8_all_gather_zero,
}


def refusal(c: Combination) -> tuple[Rule, str] | None:
    """The first rule ``c`` breaks and its message, or None when the runtime accepts it."""
    for rule, check in RULES.items():
        why = check(c)
        if why is not None:
            return rule, why
    return None


def validate_early(config: ParallelConfig) -> None:
    """Checks that need no world size and no model; run in the strategy's constructor and by
    ``l5d train`` before any process starts."""
    if config.cp > 1 and config.context.mode is ContextParallelMode.HYBRID:
        check_hybrid(config.cp, config.context.ulysses)
    pipe = config.pipeline
    if config.pp > 1:
        v = pipe.virtual_stages
        check_schedule(pipe.schedule, config.pp, v, pipe.microbatches or default_microbatches(config.pp, v))
        if pipe.stage_blocks is not None and len(pipe.stage_blocks) != config.pp * v:
            raise LayoutError(
                f"pipeline.stage_blocks={pipe.stage_blocks} has {len(pipe.stage_blocks)} entries; pp={config.pp} x "
                f"virtual_stages={v} needs {config.pp * v} (blocks per stage, in stage order)."
            )
