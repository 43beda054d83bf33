"""A training step in which one pipeline rank's step raises: every rank stops with that error.

Without the failure flag (lightning_5d/parallel/pipeline/failure.py) the other rank waits in a
receive until the process group's timeout (600 s here); the launch's own limit is far below it,
so a run that returns at all with both records shows that every rank raised promptly. The
fast tier runs the three schedule families (1F1B, interleaved 1F1B: two stages per rank with
local hand-offs, ZB-H1: split backward) in one launch, rank 1 failing at step 2; the extended
tier adds the first stage's rank failing, the V schedules, and pp=2 x dp=2 (one data rank's pipe
failing: the other pipe stops too).
"""

import json

import pytest

from tests_support import SCRIPTS, run_distributed

# [schedule, virtual stages, where the step raises, failing rank]
FAST = [
    ["1f1b", 1, "after_model", 1],  # a loss guard on the last stage
    ["interleaved_1f1b", 2, "before_model", 1],  # a bad batch: stage 1 of rank 1's stages 1 and 3
    ["zero_bubble", 1, "after_model", 1],
]
EXTENDED = [
    ["1f1b", 1, "before_model", 0],  # the first stage fails: the last stage's rank gets zeros, then the flag
    ["zbv", 2, "after_model", 0],  # V: rank 0 holds stages 0 and 3, the loss guard runs on stage 3
    ["dualpipev", 2, "before_model", 1],
]
ERRORS = {"after_model": ("FloatingPointError", "loss guard tripped at step 2"), "before_model": ("ValueError", "bad batch at step 2")}


def check(tmp_path, cases, nproc=2):
    run = run_distributed(SCRIPTS / "pipeline_step_fails.py", nproc,
                          ["--cases", json.dumps(cases), "--out", str(tmp_path)], timeout=240)  # fmt: skip
    run.check()  # every rank returned (the cases' errors were caught) within the limit
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for schedule, _, where, failing in cases:
        kind, text = ERRORS[where]
        own = records[failing][f"{schedule}/{where}/{failing}"]
        assert own["step"] == 2, (schedule, own)
        # the failing rank: its own exception, with where it was raised
        assert own["type"] == kind and own["message"].startswith(text), (schedule, own)
        assert any(f"raised on rank {failing} in pipeline stage" in n for n in own["notes"]), (schedule, own)
        # every other rank: a PipelinePeerError naming the failing rank and its exception
        for rank in set(range(nproc)) - {failing}:
            peer = records[rank][f"{schedule}/{where}/{failing}"]
            assert peer["step"] == 2, (schedule, rank, peer)
            assert peer["type"] == "PipelinePeerError" and peer["peer_rank"] == failing, (schedule, rank, peer)
            message = f"rank {failing} failed during the training step: {kind}: {text}"
            assert message in peer["message"], (schedule, rank, peer)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stage_that_raises_stops_every_rank_with_its_error(tmp_path):
    check(tmp_path, FAST)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_stage_that_raises_stops_every_rank_first_stage_and_v_schedules(tmp_path):
    check(tmp_path, EXTENDED)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_failing_pipe_stops_the_data_parallel_pipes_too(tmp_path):
    # pp=2 x dp=2: rank 3's batch is bad; the other pipe's ranks would otherwise wait in the
    # gradient reduction after the step, and rank 3's pipe peer in a receive.
    check(tmp_path, [["1f1b", 1, "before_model", 3]], nproc=4)
