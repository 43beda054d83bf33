"""Checkpoint lineage on 2 processes through FiveDStrategy: a rollback with keep_last_k keeps
what the resumed run writes, `latest` follows it, and a damaged `latest` falls back within the
run's lineage (the unit tests in tests/unit/checkpoint/test_lineage.py cover each case of the
folder logic; this one checks the strategy stamps, records and prunes as they assume)."""

import logging

import pytest

from lightning_5d.checkpoint import latest_checkpoint, lineage
from tests_support import run_layout

NUM_SAMPLES = 16  # 2 ranks x 2 sequences: 4 steps per epoch


def _train(out, steps, extra):
    out.mkdir(exist_ok=True)
    return run_layout(out, 2, zero=1, steps=steps, extra=["--num-samples", str(NUM_SAMPLES), *extra])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_rollback_with_keep_last_k_keeps_the_resumed_runs_checkpoints(tmp_path, caplog):
    out = tmp_path / "run"
    _train(out, 8, ["--save-every", "4"])  # step=4, step=8
    # A loss spike: back to step=4, keeping 2.
    _train(out, 7, ["--save-every", "1", "--keep-last-k", "2", "--resume", str(out / "step=4.ckpt")])
    assert sorted(p.name for p in out.glob("*.ckpt")) == ["step=6.ckpt", "step=7.ckpt", "step=8.ckpt"]
    assert latest_checkpoint(out) == out / "step=7.ckpt"
    record = lineage.read(out)
    new, old = (record["branches"][lineage.branch_of(record, n)] for n in ("step=7.ckpt", "step=8.ckpt"))
    assert new["run"] == old["run"] and (old["resume"], new["resume"]) == (0, 1)
    assert new["parent"]["step"] == 4
    # A shard of the newest one truncated: the run's step=6, not the abandoned step=8, is next.
    shard = max((out / "step=7.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(out) == out / "step=6.ckpt"
    assert str(shard) in caplog.text
