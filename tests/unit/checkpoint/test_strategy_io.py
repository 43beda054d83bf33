"""StrategyCheckpoints' bookkeeping (its writer and reader) that needs no process group: removals while an asynchronous
save is in flight, and what a failed background publish reports."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from lightning_5d.checkpoint import CheckpointError, files
from lightning_5d.checkpoint.strategy_io import StrategyCheckpoints
from lightning_5d.checkpoint.strategy_writer import _Pending


def _checkpoints():
    strategy = SimpleNamespace(is_global_zero=True)
    return StrategyCheckpoints(strategy, "sharded", "async")


def _complete(root, name):
    (root / name).mkdir()
    (root / name / files.COMPLETE).write_text("ok\n")
    return root / name


def test_a_removal_waits_for_the_pending_save_and_never_takes_latest(tmp_path):
    old = _complete(tmp_path, "step=2.ckpt")
    files.update_latest(old)
    checkpoints = _checkpoints()
    future = Future()
    checkpoints.writer._pending = _Pending(future)
    checkpoints.remove(old)  # ModelCheckpoint(save_top_k=1) right after starting step=4's save
    assert old.exists(), "the only complete checkpoint must survive until the new one is published"
    new = _complete(tmp_path, "step=4.ckpt")  # what the background publish does
    files.update_latest(new)
    future.set_result(None)
    checkpoints.writer._pending.done.set()
    checkpoints.wait()
    assert not old.exists() and new.exists()
    checkpoints.remove(new)  # `latest` names it: kept
    assert new.exists()


def test_a_failed_background_publish_is_raised_by_wait(tmp_path):
    checkpoints = _checkpoints()
    pending = _Pending(Future())
    pending.error = "OSError: disk full"
    pending.done.set()
    checkpoints.writer._pending = pending
    checkpoints.remove(tmp_path / "step=2.ckpt")
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed: OSError: disk full"):
        checkpoints.wait()


def test_a_load_continues_the_run_stored_in_the_checkpoint_and_a_fresh_start_draws_a_new_one():
    first, other = _checkpoints(), _checkpoints()
    assert first.branch.run != other.branch.run  # two starts without a checkpoint: two runs
    resumed = _checkpoints()
    resumed.reader._continue(first.branch.stamp(4), "step=4.ckpt")
    assert resumed.branch.run == first.branch.run and resumed.branch.resume == 1
    assert resumed.branch.parent == {"branch": first.branch.id, "step": 4}
