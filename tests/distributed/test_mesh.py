"""The sampler reads the data ranks from the mesh: shards are disjoint and cover the data."""

import json

import pytest

from tests_support import SCRIPTS, run_distributed


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sampler_shards_are_disjoint_and_cover_the_data(tmp_path):
    out = tmp_path / "seen.json"
    run_distributed(SCRIPTS / "sampler_shards.py", 4, [str(out), "2"], timeout=200).check()
    ranks = json.loads(out.read_text())
    assert [r["num_replicas"] for r in ranks] == [4] * 4
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    shards = [set(r["seen"]) for r in ranks]
    assert all(len(s) == 16 for s in shards)
    assert set().union(*shards) == set(range(64))
