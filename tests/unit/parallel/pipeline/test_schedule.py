"""Schedule choices: torch classes, stage placement, and the combinations refused before launch."""

import pytest

from lightning_5d import FiveDStrategy
from lightning_5d.config import LayoutError, PipelineSchedule
from lightning_5d.parallel.pipeline.schedule import schedule_class
from lightning_5d.pipeline_shape import check_schedule, check_stage_count, local_stages, stage_ranks


def test_every_schedule_has_a_torch_class():
    names = {s: schedule_class(s).__name__ for s in PipelineSchedule}
    assert names[PipelineSchedule.AFAB] == "ScheduleGPipe"
    assert names[PipelineSchedule.ONE_F_ONE_B] == "Schedule1F1B"
    assert len(set(names.values())) == len(names)


def test_looped_and_v_placement():
    assert stage_ranks("interleaved_1f1b", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_ranks("zbv", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert local_stages("dualpipev", 4, 2, 0) == [0, 7]
    assert local_stages("1f1b", 4, 1, 2) == [2]


@pytest.mark.parametrize(
    "schedule,pp,v,m,match",
    [
        ("1f1b", 2, 2, 4, "virtual_stages=1"),
        ("afab", 2, 3, 4, "virtual_stages=1"),
        ("interleaved_1f1b", 2, 1, 4, "virtual_stages >= 2"),
        ("zbv", 2, 1, 4, "exactly 2 stages per rank"),
        ("dualpipev", 4, 2, 4, "at least as many microbatches as stages"),
        ("interleaved_1f1b", 4, 2, 9, "rounds of pp=4"),
    ],
)
def test_bad_combinations_are_refused(schedule, pp, v, m, match):
    with pytest.raises(LayoutError, match=match):
        check_schedule(schedule, pp, v, m)


def test_layers_fewer_than_stages():
    with pytest.raises(LayoutError, match="pp=4 x virtual_stages=2 needs at least 8"):
        check_stage_count(6, 4, 2)


def test_strategy_constructor_checks_the_schedule_before_any_process_starts():
    with pytest.raises(LayoutError, match="exactly 2 stages per rank"):
        FiveDStrategy(pp=2, pipeline={"schedule": "zbv", "virtual_stages": 1})
    with pytest.raises(LayoutError, match="stage_blocks"):
        FiveDStrategy(pp=2, pipeline={"stage_blocks": [1, 1, 1]})
    with pytest.raises(LayoutError, match="pipeline.balance"):
        FiveDStrategy(pp=2, pipeline={"balance": "flops"})
