"""The ranking order of `l5d plan` (ranking.py) and the line that says why #1 beats #2."""

from dataclasses import replace

import pytest

from lightning_5d.estimate import GIB, Cluster, estimate, predict_step_time
from lightning_5d.estimate.ranking import CRITERIA, Candidate, deciding_criterion, rank_key, why_ahead
from lightning_5d.estimate.report import format_plan
from lightning_5d.estimate.search import PlanEntry

CLUSTER = Cluster(gpus=4)
USABLE = CLUSTER.usable_memory_bytes


@pytest.fixture(scope="module")
def small():
    """Two tiny layouts, same batch: ZeRO-1 (more memory) and ZeRO-3 (less)."""
    z1 = estimate("l5d-tiny", dp_shard=4, zero=1, seq_len=256)
    z3 = estimate("l5d-tiny", dp_shard=4, zero=3, seq_len=256)
    assert z3.memory.total < z1.memory.total
    return z1, z3


def _time(est, total_compute=1.0, exposed_dp=0.0, bubble=0.0, comm_dp=0.0):
    t = predict_step_time(est, CLUSTER)
    return replace(
        t,
        compute=total_compute,
        bubble=bubble,
        exposed={**t.exposed, "dp": exposed_dp, "tp": 0.0, "cp": 0.0, "pp": 0.0, "ep": 0.0},
        comm={**{d: 0.0 for d in t.comm}, "dp": comm_dp},
        link_busy=0.0,
    )


def test_criteria_order_is_the_documented_one():
    names = [c.name for c in CRITERIA]
    assert names[:5] == [
        "step time",
        "exposed communication",
        "memory headroom",
        "bubble",
        "communication time (hidden included)",
    ]


def test_faster_step_wins_over_everything_after_it(small):
    z1, z3 = small
    fast = Candidate(z1, _time(z1, 1.0, exposed_dp=0.05), USABLE)
    slow = Candidate(z3, _time(z3, 1.1), USABLE)
    assert deciding_criterion(fast, slow).name == "step time"
    assert rank_key(fast) < rank_key(slow)


def test_equal_step_time_goes_to_less_exposed_communication(small):
    z1, z3 = small
    # Same total (compute + exposed): the one that hides more of its traffic ranks first.
    hidden = Candidate(z1, _time(z1, 1.0), USABLE)
    exposed = Candidate(z3, _time(z3, 0.99, exposed_dp=0.01), USABLE)
    assert deciding_criterion(hidden, exposed).name == "exposed communication"
    assert rank_key(hidden) < rank_key(exposed)


def test_then_memory_headroom_then_bubble(small):
    z1, z3 = small
    roomy = Candidate(z3, _time(z3, 0.9, bubble=0.1), USABLE)
    tight = Candidate(z1, _time(z1, 1.0), USABLE)
    assert deciding_criterion(roomy, tight).name == "memory headroom"
    assert rank_key(roomy) < rank_key(tight)
    # Same layout (same memory), same step: the smaller bubble first.
    no_bubble = Candidate(z1, _time(z1, 1.0), USABLE)
    bubble = Candidate(z1, _time(z1, 0.95, bubble=0.05), USABLE)
    assert deciding_criterion(no_bubble, bubble).name == "bubble"
    assert rank_key(no_bubble) < rank_key(bubble)


def test_differences_below_the_printed_precision_do_not_decide(small):
    z1, _ = small
    a = Candidate(z1, _time(z1, 1.0, comm_dp=0.2), USABLE)
    b = Candidate(z1, _time(z1, 1.0 + 1e-9, comm_dp=0.1), USABLE)
    assert deciding_criterion(a, b).name == "communication time (hidden included)"
    assert rank_key(b) < rank_key(a)


def test_reason_line_names_the_deciding_criterion_with_both_values(small):
    z1, z3 = small
    first = Candidate(z3, _time(z3, 1.0), USABLE)
    second = Candidate(z1, _time(z1, 1.0), USABLE)
    free = [(USABLE - est.memory.total) / GIB for est in (z3, z1)]
    used = [est.memory.total / 2**20 for est in (z3, z1)]
    line = why_ahead(first, second)
    first_text, second_text = (f"{f:.1f} GiB free ({u:.3g} MiB used)" for f, u in zip(free, used, strict=True))
    assert line.startswith(f"memory headroom: {first_text} vs {second_text}")
    assert "equal step time (1.000 s), exposed communication" in line


def test_plan_table_prints_why_first_beats_second(small):
    z1, z3 = small
    a, b = Candidate(z3, _time(z3, 1.0), USABLE), Candidate(z1, _time(z1, 1.0), USABLE)
    entries = [
        PlanEntry(1, z3, a.time, True, "why #1", why_ahead(a, b)),
        PlanEntry(2, z1, b.time, True, "why #2", ""),
    ]
    last = format_plan(entries).splitlines()[-1]
    assert last == f"#1 beats #2 on {why_ahead(a, b)}"


def test_rows_alike_in_every_prediction_say_so(small):
    z1, _ = small
    a, b = Candidate(z1, _time(z1, 1.0), USABLE), Candidate(z1, _time(z1, 1.0), USABLE)
    assert why_ahead(a, b) == "identical in every criterion"
    # Another split of the same batch (mbs 2, no accumulation), given the same numbers: only its text differs.
    other = estimate("l5d-tiny", dp_shard=4, zero=1, seq_len=256, micro_batch_size=2, grad_accum=1)
    c = Candidate(replace(other, memory=z1.memory, flops=z1.flops), _time(z1, 1.0), USABLE)
    assert deciding_criterion(a, c).name == "layout"
    first, second = sorted([a, c], key=rank_key)
    assert why_ahead(first, second) == "no prediction differs; ordered by layout text"
