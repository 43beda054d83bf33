"""Action lists read from torch's schedule objects, and their simulation: completeness, placement, bubbles."""

from collections import Counter
from fractions import Fraction

import pytest

from lightning_5d.config import LayoutError, PipelineSchedule
from lightning_5d.estimate.schedule import bubble_fraction
from lightning_5d.parallel.pipeline.actions import (
    Action,
    ActionCosts,
    ActionKind,
    ScheduleDeadlockError,
    action_lists,
    simulate,
)
from lightning_5d.pipeline_shape import stage_ranks

F, B, IG, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)  # IG: input grad
STAGES_PER_RANK = {
    PipelineSchedule.AFAB: 1,
    PipelineSchedule.ONE_F_ONE_B: 1,
    PipelineSchedule.INTERLEAVED_1F1B: 2,
    PipelineSchedule.ZERO_BUBBLE: 1,
    PipelineSchedule.ZBV: 2,
    PipelineSchedule.DUALPIPEV: 2,
}
CASES = [(schedule, pp, v) for schedule, v in STAGES_PER_RANK.items() for pp in (2, 4)]
M = 8


def exact_bubble(timeline) -> Fraction:
    """Idle / (ranks x makespan) in exact arithmetic (unit costs make every time an integer)."""
    total = Fraction(timeline.ranks) * Fraction(timeline.makespan)
    busy = sum(Fraction(timeline.busy(r)) for r in range(timeline.ranks))
    return (total - busy) / total


@pytest.mark.parametrize("schedule,pp,v", CASES)
def test_each_stage_and_microbatch_gets_one_forward_and_one_complete_backward(schedule, pp, v):
    lists = action_lists(schedule, pp, M, v)
    count = Counter((a.kind, a.stage, a.microbatch) for row in lists.values() for a in row)
    for stage in range(pp * v):
        for mb in range(M):
            assert count[(F, stage, mb)] == 1, (stage, mb)
            full, split = count[(B, stage, mb)], (count[(IG, stage, mb)], count[(W, stage, mb)])
            assert (full, split) in ((1, (0, 0)), (0, (1, 1))), (stage, mb, full, split)
    assert sum(count.values()) == sum(len(row) for row in lists.values())  # nothing else, nothing twice


@pytest.mark.parametrize("schedule,pp,v", CASES)
def test_each_rank_runs_only_its_own_stages(schedule, pp, v):
    owner = stage_ranks(schedule, pp, v)
    lists = action_lists(schedule, pp, M, v)
    assert sorted(lists) == list(range(pp))
    for rank, row in lists.items():
        assert {owner[a.stage] for a in row} == {rank}


@pytest.mark.parametrize("schedule,pp,v", CASES)
def test_simulation_keeps_every_dependency_and_never_overlaps_a_rank(schedule, pp, v):
    timeline = simulate(action_lists(schedule, pp, M, v))
    ends = {iv.action: iv.end for row in timeline.intervals.values() for iv in row}
    last = pp * v - 1
    for row in timeline.intervals.values():
        for before, after in zip(row, row[1:]):
            assert before.end <= after.start
        for iv in row:
            a = iv.action
            if a.kind == F and a.stage > 0:
                assert iv.start >= ends[Action(F, a.stage - 1, a.microbatch)]
            if a.kind in (B, IG):
                assert iv.start >= ends[Action(F, a.stage, a.microbatch)]
                if a.stage < last:
                    upstream = (
                        ends.get(Action(B, a.stage + 1, a.microbatch)) or ends[Action(IG, a.stage + 1, a.microbatch)]
                    )
                    assert iv.start >= upstream
            if a.kind == W:
                assert iv.start >= ends[Action(IG, a.stage, a.microbatch)]


@pytest.mark.parametrize("schedule", [PipelineSchedule.AFAB, PipelineSchedule.ONE_F_ONE_B])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize(
    "costs",
    [ActionCosts(), ActionCosts(forward=2, backward_input=1, backward_weight=1), ActionCosts(1, 2, 1)],
    ids=["B=2F", "B=F", "B=3F"],
)
def test_gpipe_and_1f1b_bubble_is_exactly_p_minus_1_over_m_plus_p_minus_1(schedule, pp, m, costs):
    timeline = simulate(action_lists(schedule, pp, m, 1), costs)
    step = costs.forward + costs.backward_input + costs.backward_weight
    assert timeline.makespan == (m + pp - 1) * step
    assert exact_bubble(timeline) == Fraction(pp - 1, m + pp - 1)
    assert timeline.bubble_fraction() == pytest.approx(bubble_fraction(pp, m, 1, schedule), abs=1e-12)


@pytest.mark.parametrize(
    "schedule,v,m",
    [
        (PipelineSchedule.INTERLEAVED_1F1B, 2, 8),
        (PipelineSchedule.INTERLEAVED_1F1B, 2, 16),
        (PipelineSchedule.ZERO_BUBBLE, 1, 8),
        (PipelineSchedule.ZERO_BUBBLE, 1, 16),
        (PipelineSchedule.ZBV, 2, 8),
        (PipelineSchedule.ZBV, 2, 16),
    ],
)
def test_torch_schedules_meet_the_planner_formula_at_unit_costs(schedule, v, m):
    assert simulate(action_lists(schedule, 4, m, v)).bubble_fraction() == pytest.approx(
        bubble_fraction(4, m, v, schedule), abs=1e-12
    )


def test_zero_bubble_schedules_idle_less_than_1f1b():
    one_f_one_b = simulate(action_lists("1f1b", 4, 8, 1)).bubble_fraction()
    for schedule, v in (("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2)):
        assert simulate(action_lists(schedule, 4, 8, v)).bubble_fraction() < one_f_one_b, schedule


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_activations_in_flight_on_the_first_stage(pp, m):
    assert simulate(action_lists("1f1b", pp, m, 1)).peak_in_flight(0) == min(pp, m)
    assert simulate(action_lists("afab", pp, m, 1)).peak_in_flight(0) == m


def test_dualpipev_overlapped_pairs_become_a_forward_then_a_full_backward():
    row = action_lists("dualpipev", 4, 8, 2)[0]
    # torch: (0F7;7B3)OVERLAP_F_B, run as 0F7 then 7B3
    i = row.index(Action(F, 0, 7))
    assert row[i + 1] == Action(B, 7, 3)


@pytest.mark.parametrize(
    "schedule,pp,v,m,match",
    [
        # check_schedule's own cases are in test_schedule.py; torch's constructors refuse these
        # too: a LayoutError either way (check_schedule's or torch's, wrapped)
        ("afab", 4, 1, 0, "must be >= 1"),
        ("1f1b", 4, 1, 2, "microbatches=2"),
        ("zero_bubble", 4, 1, 17, "microbatches=17"),
    ],
)
def test_bad_input_raises_layout_error(schedule, pp, v, m, match):
    with pytest.raises(LayoutError, match=match):
        action_lists(schedule, pp, m, v)


def test_a_deadlock_names_the_rank_and_the_action():
    lists = {
        0: [Action(B, 0, 0), Action(F, 0, 0)],  # backward before its own forward
        1: [Action(F, 1, 0), Action(B, 1, 0)],
    }
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 at its action #0, B0 of stage 0, waits for forward 0"):
        simulate(lists)


def test_costs_must_be_positive():
    with pytest.raises(ValueError, match="forward=0"):
        ActionCosts(forward=0)
