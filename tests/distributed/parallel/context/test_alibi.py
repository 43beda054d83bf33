"""An ALiBi model under context parallelism (issue 22): the first step's loss and every
parameter's gradient equal one process's, for zig-zag and contiguous sharding and the ring and
all-gather modes (scripts/cp_alibi_grads.py). The kernel-level check (forward and backward of
biased blocks against fp64 SDPA) is in the fast tier's ring launch (test_ring.py)."""

import json
from pathlib import Path

import pytest

from tests_support import run_distributed

SCRIPT = Path(__file__).parents[2] / "scripts" / "cp_alibi_grads.py"


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(300)
def test_alibi_model_gradients_equal_one_process(tmp_path):
    out = tmp_path / "grads.json"
    run_distributed(SCRIPT, 2, ["--out", str(out)], timeout=250).check()
    records = json.loads(out.read_text())
    assert [r["case"] for r in records] == ["zigzag:ring", "contiguous:ring", "zigzag:allgather"]
    for r in records:
        assert "ALiBi bias rebuilt from global positions" in r["attention"], r
        assert r["got_grads"] == r["params"] > 0, r
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["worst_grad_error"] <= 1e-5, r
