"""CollectiveCounter on real process groups: every counted collective, exact bytes."""

import pytest

from tests_support import SCRIPTS, run_distributed


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_counter_records_exact_bytes_for_each_collective(tmp_path):
    # 3 ranks, so that (N-1)/N is not 1/2 and a sub-group of 2 differs from the world.
    run_distributed(SCRIPTS / "collectives_count.py", 3, ["--out", str(tmp_path)], timeout=150).check()
    assert (tmp_path / "result.txt").read_text() == "OK"
