"""The multi-process harness (lightning_5d.launch.run_ranks) turns a hang into a failed run."""

import pytest

from lightning_5d.testing import run_distributed
from tests_support import SCRIPTS


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_hanging_run_is_stopped_at_its_time_limit():
    # The rank sleeps for an hour; returning at all (within the test's own 120 s limit)
    # means the harness stopped it.
    run = run_distributed(SCRIPTS / "hang.py", 2, timeout=10)
    assert run.timed_out and "started" in run.output
    with pytest.raises(AssertionError, match="timed out"):
        run.check()
