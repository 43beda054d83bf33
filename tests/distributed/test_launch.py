"""The multi-process harness turns a hang into a failed run, under both launchers
(lightning_5d.launch.run_ranks via torchrun, and lightning_5d.fork_launch)."""

import time

import pytest

from lightning_5d.testing import Launcher, run_distributed
from tests_support import SCRIPTS


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", [Launcher.TORCHRUN, Launcher.FORK])
def test_a_hanging_run_is_stopped_at_its_time_limit(launcher):
    # The rank sleeps for an hour; returning at all (within the test's own 120 s limit)
    # means the harness stopped it.
    run = run_distributed(SCRIPTS / "hang.py", 2, timeout=10, launcher=launcher)
    assert run.timed_out
    if launcher is Launcher.FORK:  # no imports to wait for: both ranks were running when stopped
        assert run.output.count("started") == 2
    with pytest.raises(AssertionError, match="timed out"):
        run.check()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_failing_rank_stops_the_others_and_every_rank_gets_its_environment():
    start = time.monotonic()
    run = run_distributed(SCRIPTS / "rank_fails.py", 2, timeout=100, launcher=Launcher.FORK)
    assert not run.timed_out and run.returncode != 0
    assert time.monotonic() - start < 90  # stopped after the failure, not at the time limit
    assert "rank 0 of 2 (local 0)" in run.output and "rank 1 of 2 (local 1)" in run.output
    assert "RuntimeError: rank 1 fails on purpose" in run.output
