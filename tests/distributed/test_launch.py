"""The multi-process harness turns a hang into a failed run, under both launchers
(lightning_5d.launch.run_ranks via torchrun, and lightning_5d.fork_launch)."""

import shutil
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
        # Each rank stopped shows where it waited: its Python stack, and gdb's native one.
        assert run.output.count('hang.py", line 6') == 2, run.output[-3000:]
        if shutil.which("gdb"):
            assert run.output.count("Thread 1 ") == 2 and "sleep" in run.output, run.output[-3000:]
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


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_leave_that_does_not_finish_fails_with_its_stacks():
    start = time.monotonic()
    run = run_distributed(SCRIPTS / "leave_hangs.py", 2, timeout=100, launcher=Launcher.FORK)
    assert not run.timed_out and run.returncode != 0
    assert time.monotonic() - start < 60  # the leave's 5 s limit, not the launch's 100 s
    assert "rank 0: leaving the process group did not finish in 5 s" in run.output
    assert "in monitored_barrier" in run.output, run.output[-3000:]  # where rank 0 waited
