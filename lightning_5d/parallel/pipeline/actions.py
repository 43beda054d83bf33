"""The compute actions each pipeline rank runs, read from torch's own schedule objects, and a simulation of them.

:func:`action_lists` builds the torch schedule class the runtime uses (:func:`schedule_class`) and
reads the per-rank order it computes, so a drawing shows the schedule that runs rather than a
re-implementation of it. :func:`simulate` then times those lists with a cost per action kind and
the data dependencies between stages, giving per-rank busy intervals, the idle fraction (bubble)
and the activations held. Symbols: p pipeline ranks, v stages per rank, m microbatches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

from lightning_5d.config import LayoutError, PipelineSchedule
from lightning_5d.pipeline_shape import SINGLE_STAGE, check_schedule, local_stages

from .schedule import schedule_class


class ActionKind(str, Enum):
    """Compute work on one (stage, microbatch). Values are the one-letter names torch and the drawings use.

    torch's DualPipeV also emits OVERLAP_F_B, a forward of one chunk paired with a full backward of
    the other. Its runtime performs the two parts one after the other (each waiting only on its own
    inputs), so :func:`action_lists` replaces it by its parts, in order, and there is no kind for it.
    """

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients in one action
    BACKWARD_INPUT = "I"  # input gradients only; what the previous stage waits for
    BACKWARD_WEIGHT = "W"  # weight gradients only; nothing waits for it, so it can fill idle time


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch} of stage {self.stage}"


_FROM_TORCH = {
    torch_schedules._ComputationType.FORWARD: ActionKind.FORWARD,
    torch_schedules._ComputationType.FULL_BACKWARD: ActionKind.BACKWARD,
    torch_schedules._ComputationType.BACKWARD_INPUT: ActionKind.BACKWARD_INPUT,
    torch_schedules._ComputationType.BACKWARD_WEIGHT: ActionKind.BACKWARD_WEIGHT,
}


@dataclass
class _StandInStage:
    """The few stage attributes torch's schedule constructors read, so they run without a process group.

    A real ``PipelineStage`` needs an initialised process group and a module; the constructors only
    read the sizes below (and ``submod`` for a torch.compile check) and write the stage-to-rank map.
    """

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)


def action_lists(schedule: PipelineSchedule | str, pp: int, microbatches: int, v: int = 1) -> dict[int, list[Action]]:
    """Per pipeline rank, the compute actions torch's schedule for ``schedule`` runs, in order."""
    schedule = PipelineSchedule(schedule)
    check_schedule(schedule, pp, v, microbatches)
    order = _torch_pipeline_order(schedule, pp, microbatches, v)
    lists = {rank: _compute_actions(order[rank]) for rank in range(pp)}
    if schedule in SINGLE_STAGE:
        lists = {rank: _forwards_in_order(actions) for rank, actions in lists.items()}
    return lists


def _torch_pipeline_order(schedule: PipelineSchedule, pp: int, microbatches: int, v: int) -> dict[int, list]:
    cls = schedule_class(schedule)
    stages = [_StandInStage(s, pp * v, pp) for s in local_stages(schedule, pp, v, rank=0)]
    try:
        if schedule in SINGLE_STAGE:
            # The single-stage classes run a hand-written loop; _get_pipeline_order is their
            # description of that loop as per-rank action lists.
            order = cls(stages[0], microbatches)._get_pipeline_order()
        else:
            # Every rank's list is computed in the constructor (from _calculate_single_rank_operations)
            # and is what _PipelineScheduleRuntime executes, after adding communication.
            order = cls(stages, microbatches).pipeline_order
    except (ValueError, AssertionError) as err:
        raise LayoutError(
            f"torch's {cls.__name__} refuses pipeline.schedule={schedule.value} with pp={pp}, "
            f"virtual_stages={v}, microbatches={microbatches}: {err}"
        ) from err
    if not order:
        raise LayoutError(f"torch's {cls.__name__} gives no per-rank action lists to draw.")
    return order


def _compute_actions(torch_actions: list) -> list[Action]:
    """Forward and backward work only: idle slots (None), sends, receives, unshards and grad reductions dropped."""
    actions = []
    for item in torch_actions:
        if item is None:
            continue
        for part in item.sub_actions or (item,):  # OVERLAP_F_B: its parts, in the order torch runs them
            kind = _FROM_TORCH.get(part.computation_type)
            if kind is not None:
                actions.append(Action(kind, part.stage_index, part.microbatch_index))
    return actions


def _forwards_in_order(actions: list[Action]) -> list[Action]:
    """Number a single-stage rank's forwards 0, 1, 2, ... in the order they run.

    GPipe's and 1F1B's run loops forward microbatches in index order. torch 2.13's
    ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..m instead of
    0..m-1 (its counter is bumped before the first use when the rank has no warm-up forwards);
    the order of F and B actions it gives is the loop's. Renumbering leaves a correct list as it is.
    """
    forwards = iter(range(len(actions)))
    return [dataclasses.replace(a, microbatch=next(forwards)) if a.kind == ActionKind.FORWARD else a for a in actions]


# ---------------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class ActionCosts:
    """Time of one action on one stage; a full backward costs backward_input + backward_weight."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ActionCosts.{name}={getattr(self, name)} must be > 0.")

    def of(self, kind: ActionKind) -> float:
        if kind == ActionKind.FORWARD:
            return self.forward
        if kind == ActionKind.BACKWARD_INPUT:
            return self.backward_input
        if kind == ActionKind.BACKWARD_WEIGHT:
            return self.backward_weight
        return self.backward_input + self.backward_weight


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    action: Action


class ScheduleDeadlockError(RuntimeError):
    """No rank can start its next action: each waits on work that has not run (or never runs)."""


@dataclass(frozen=True)
class Timeline:
    """When each rank runs each of its actions, in the order its list gives."""

    intervals: dict[int, tuple[Interval, ...]]
    costs: ActionCosts

    @property
    def ranks(self) -> int:
        return len(self.intervals)

    @property
    def makespan(self) -> float:
        return max((row[-1].end for row in self.intervals.values() if row), default=0.0)

    @property
    def num_stages(self) -> int:
        return 1 + max(iv.action.stage for row in self.intervals.values() for iv in row)

    @property
    def microbatches(self) -> int:
        return 1 + max(iv.action.microbatch for row in self.intervals.values() for iv in row)

    def stages_on(self, rank: int) -> list[int]:
        return sorted({iv.action.stage for iv in self.intervals[rank]})

    def busy(self, rank: int) -> float:
        return sum(iv.end - iv.start for iv in self.intervals[rank])

    def bubble_fraction(self) -> float:
        """Idle time over all ranks' time: idle / (ranks x makespan), e.g. (p-1)/(m+p-1) for 1F1B."""
        total = self.ranks * self.makespan
        if total == 0:
            return 0.0
        return (total - sum(self.busy(r) for r in self.intervals)) / total

    def peak_in_flight(self, stage: int = 0) -> int:
        """Most microbatches forwarded through ``stage`` whose backward has not started yet.

        Counted up to the first backward piece (full B or I): the input-gradient pass is the one
        that consumes the stored activations; W needs only the stage input and output gradient.
        """
        held = peak = 0
        for iv in self._on_stage(stage):
            if iv.action.kind == ActionKind.FORWARD:
                held += 1
                peak = max(peak, held)
            elif iv.action.kind in _FIRST_BACKWARD:
                held -= 1
        return peak

    def _on_stage(self, stage: int) -> list[Interval]:
        return sorted(
            (iv for row in self.intervals.values() for iv in row if iv.action.stage == stage),
            key=lambda iv: iv.start,
        )


_FIRST_BACKWARD = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
# What an action's finishing makes possible, keyed (step, stage, microbatch). A full B is also the
# input-gradient step; a W of a microbatch whose stage ran a full B never occurs.
_FORWARD_DONE, _INPUT_GRAD_DONE = "forward", "input_grad"


def _needs(action: Action, last_stage: int) -> list[tuple[str, int, int]]:
    s, mb = action.stage, action.microbatch
    if action.kind == ActionKind.FORWARD:
        return [(_FORWARD_DONE, s - 1, mb)] if s > 0 else []
    if action.kind in _FIRST_BACKWARD:
        needs = [(_FORWARD_DONE, s, mb)]
        return needs + ([(_INPUT_GRAD_DONE, s + 1, mb)] if s < last_stage else [])
    return [(_INPUT_GRAD_DONE, s, mb)]  # W after this stage's own I


def _provides(action: Action) -> tuple[str, int, int] | None:
    if action.kind == ActionKind.FORWARD:
        return (_FORWARD_DONE, action.stage, action.microbatch)
    if action.kind in _FIRST_BACKWARD:
        return (_INPUT_GRAD_DONE, action.stage, action.microbatch)
    return None


def simulate(actions: dict[int, list[Action]], costs: ActionCosts = ActionCosts()) -> Timeline:
    """Run every rank's list in order; each action starts once its rank is free and its inputs are done."""
    last_stage = max(a.stage for row in actions.values() for a in row)
    _check_each_action_once(actions)
    done: dict[tuple[str, int, int], float] = {}
    rows: dict[int, list[Interval]] = {rank: [] for rank in actions}
    free = {rank: 0.0 for rank in actions}
    while True:
        progress = False
        for rank, row in actions.items():
            while len(rows[rank]) < len(row):
                action = row[len(rows[rank])]
                needs = _needs(action, last_stage)
                if any(n not in done for n in needs):
                    break
                start = max([free[rank], *(done[n] for n in needs)])
                free[rank] = end = start + costs.of(action.kind)
                rows[rank].append(Interval(start, end, action))
                if (provided := _provides(action)) is not None:
                    done[provided] = end
                progress = True
        if all(len(rows[r]) == len(actions[r]) for r in actions):
            return Timeline({rank: tuple(row) for rank, row in rows.items()}, costs)
        if not progress:
            raise ScheduleDeadlockError(_deadlock_message(actions, rows, done, last_stage))


def _check_each_action_once(actions: dict[int, list[Action]]) -> None:
    seen: dict[Action, int] = {}
    for rank, row in actions.items():
        for action in row:
            if action in seen:
                raise ValueError(f"{action} is listed twice (ranks {seen[action]} and {rank}).")
            seen[action] = rank


def _deadlock_message(actions, rows, done, last_stage) -> str:
    provided_anywhere = {_provides(a) for row in actions.values() for a in row}
    blocked = []
    for rank, row in actions.items():
        step = len(rows[rank])
        if step == len(row):
            continue
        action = row[step]
        waits = []
        for step_name, stage, mb in _needs(action, last_stage):
            if (step_name, stage, mb) in done:
                continue
            what = f"{'forward' if step_name == _FORWARD_DONE else 'input-gradient backward'} {mb} of stage {stage}"
            never = (step_name, stage, mb) not in provided_anywhere
            waits.append(what + (" (which no rank runs)" if never else ""))
        blocked.append(f"rank {rank} at its action #{step}, {action}, waits for {' and '.join(waits)}")
    return "the pipeline schedule deadlocks: " + "; ".join(blocked)
