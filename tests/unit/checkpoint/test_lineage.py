"""Lineage of a checkpoint folder: `latest` and keep_last_k follow the run's own history
(rollbacks, re-runs and other runs in the same folder), and a damaged newest checkpoint gives
way to the newest intact one of its lineage."""

import json
import logging

from lightning_5d.checkpoint import files, lineage
from lightning_5d.checkpoint.lineage import Branch


def _save(root, name, branch, step, keep_last_k=None):
    """What rank 0 does for one sharded save: stamp and publish the directory, record, move latest, prune."""
    partial = files.partial_path(root / name)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(bytes([step % 256]) * (100 + step))
    (partial / files.COMPLETE).write_text(files.stamp_files(partial, step))
    files.publish(partial, root / name)
    notes = files.update_latest(root / name, branch, step)
    if keep_last_k is not None:
        files.prune(root, keep_last_k, branch=branch)
    return notes


def _names(root):
    return sorted(p.name for p in root.glob("*.ckpt"))


def test_rollback_with_keep_last_k_keeps_what_the_resumed_run_writes(tmp_path, caplog):
    first = Branch.fresh()
    _save(tmp_path, "step=4.ckpt", first, 4)
    _save(tmp_path, "step=8.ckpt", first, 8)
    # A loss spike: resume from step=4 with keep_last_k=1.
    resumed = Branch.resumed_from(first.stamp(4))
    assert resumed.run == first.run and resumed.resume == 1
    notes = _save(tmp_path, "step=6.ckpt", resumed, 6, keep_last_k=1)
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=6.ckpt"
    assert _names(tmp_path) == ["step=6.ckpt", "step=8.ckpt"]  # step=4 pruned; the abandoned step=8 kept
    assert len(notes) == 1 and "abandoned branch" in notes[0] and "step=8.ckpt" in notes[0]
    _save(tmp_path, "step=7.ckpt", resumed, 7, keep_last_k=1)
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=7.ckpt"
    assert _names(tmp_path) == ["step=7.ckpt", "step=8.ckpt"]
    # Reaching step 8 again republishes the name: it now belongs to the resumed branch.
    _save(tmp_path, "step=8.ckpt", resumed, 8, keep_last_k=1)
    assert _names(tmp_path) == ["step=8.ckpt"]
    record = lineage.read(tmp_path)
    assert lineage.branch_of(record, "step=8.ckpt") == resumed.id


def test_a_rerun_into_a_used_folder_keeps_its_own_checkpoints(tmp_path):
    old = Branch.fresh()
    for step in (2, 4, 6, 8):
        _save(tmp_path, f"step={step}.ckpt", old, step)
    rerun = Branch.fresh()
    for step in (2, 4, 6):
        notes = _save(tmp_path, f"step={step}.ckpt", rerun, step, keep_last_k=2)
        assert files.latest_checkpoint(tmp_path) == tmp_path / f"step={step}.ckpt"
    assert _names(tmp_path) == ["step=4.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert {lineage.branch_of(lineage.read(tmp_path), n) for n in ("step=4.ckpt", "step=6.ckpt")} == {rerun.id}
    assert lineage.branch_of(lineage.read(tmp_path), "step=8.ckpt") == old.id  # another run's: kept
    assert notes == []  # said once, at the rerun's first save


def test_a_fresh_run_in_a_shared_requeue_folder_moves_latest_to_its_own_save(tmp_path):
    earlier = Branch.fresh(job="local")
    _save(tmp_path, "requeue-step=20.ckpt", earlier, 20)
    fresh = Branch.fresh(job="local")
    notes = _save(tmp_path, "requeue-step=5.ckpt", fresh, 5)
    assert files.latest_checkpoint(tmp_path) == tmp_path / "requeue-step=5.ckpt"  # the requeued job continues it
    assert "another run" in notes[0] and "requeue-step=20.ckpt" in notes[0]
    assert (tmp_path / "requeue-step=20.ckpt").exists()


def test_a_damaged_latest_falls_back_to_the_newest_intact_checkpoint_of_its_lineage(tmp_path, caplog):
    other, run = Branch.fresh(), Branch.fresh()
    _save(tmp_path, "step=9.ckpt", other, 9)  # another run's, higher step: never the fallback
    _save(tmp_path, "step=2.ckpt", run, 2)
    _save(tmp_path, "step=4.ckpt", run, 4)
    shard = tmp_path / "step=4.ckpt" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    with caplog.at_level(logging.WARNING):
        assert files.latest_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"
    assert str(shard) in caplog.text and "10 bytes, 104 were written" in caplog.text
    assert "falling back to step=2.ckpt" in caplog.text
    (tmp_path / "step=2.ckpt" / "__0_0.distcp").unlink()
    assert files.latest_checkpoint(tmp_path) is None  # nothing of this lineage left: a fresh start, said so
    assert "no intact checkpoint" in caplog.text


def test_a_truncated_full_format_file_is_found_by_the_recorded_size(tmp_path):
    run = Branch.fresh()
    for step in (2, 4):
        (tmp_path / f"step={step}.ckpt").write_bytes(b"x" * 64)
        files.update_latest(tmp_path / f"step={step}.ckpt", run, step)
    (tmp_path / "step=4.ckpt").write_bytes(b"x" * 10)
    assert "10 bytes, 64 were written" in files.damage(tmp_path / "step=4.ckpt")
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"


def test_latest_names_only_a_checkpoint_in_its_own_folder(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere.ckpt"
    elsewhere.write_bytes(b"x")
    root = tmp_path / "run"
    root.mkdir()
    _save(root, "step=2.ckpt", Branch.fresh(), 2)
    (root / files.LATEST).write_text("../elsewhere.ckpt\n")
    with caplog.at_level(logging.WARNING):
        assert files.latest_checkpoint(root) == root / "step=2.ckpt"
    assert "not a checkpoint in its own folder" in caplog.text


def test_the_record_survives_a_kill_between_publish_and_record(tmp_path):
    run = Branch.fresh()
    _save(tmp_path, "step=2.ckpt", run, 2)
    before = (tmp_path / lineage.LINEAGE).read_text()
    # Killed after the rename of step=4, before the record and `latest`: both still name step=2.
    partial = files.partial_path(tmp_path / "step=4.ckpt")
    partial.mkdir()
    (partial / files.COMPLETE).write_text(files.stamp_files(partial, 4))
    files.publish(partial, tmp_path / "step=4.ckpt")
    assert (tmp_path / lineage.LINEAGE).read_text() == before
    assert (tmp_path / files.LATEST).read_text().strip() == "step=2.ckpt"
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"
    assert json.loads(before)["branches"][run.id]["run"] == run.run
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_checkpoint_without_a_stamp_starts_a_run_of_its_own():
    branch = Branch.resumed_from(None)
    assert branch.parent is None and branch.resume == 0
    again = Branch.resumed_from(branch.stamp(3))
    assert again.run == branch.run and again.parent == {"branch": branch.id, "step": 3}


def test_only_step_numbered_checkpoints_of_the_lineage_are_pruned(tmp_path):
    run = Branch.fresh()
    _save(tmp_path, "step=2.ckpt", run, 2)
    _save(tmp_path, "last.ckpt", run, 2)  # ModelCheckpoint(save_last=True) after its top-k save
    _save(tmp_path, "step=4.ckpt", run, 4, keep_last_k=1)
    assert _names(tmp_path) == ["last.ckpt", "step=4.ckpt"]


def test_without_a_pointer_the_most_recently_written_checkpoint_wins_not_the_highest_step(tmp_path):
    old, rerun = Branch.fresh(), Branch.fresh()
    _save(tmp_path, "step=8.ckpt", old, 8)
    _save(tmp_path, "step=2.ckpt", rerun, 2)
    (tmp_path / files.LATEST).unlink()  # e.g. killed before the first `latest` of a new folder copy
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"
    (tmp_path / files.LATEST).write_text("step=2.ckpt\n")
    files.remove(tmp_path / "step=2.ckpt")  # removed by hand: the run's lineage has nothing left
    assert files.latest_checkpoint(tmp_path) is None


def test_a_run_missing_from_the_record_prunes_nothing(tmp_path, caplog):
    """Another writer's record replaced ours (two runs in one folder): ranking every checkpoint
    by step would delete the other run's work, so keep_last_k leaves the folder alone."""
    other, ours = Branch.fresh(), Branch.fresh()
    for step in (2, 4):
        _save(tmp_path, f"step={step}.ckpt", other, step)
    _save(tmp_path, "step=6.ckpt", ours, 6)
    record = lineage.read(tmp_path)
    del record["branches"][ours.id]
    lineage.write(tmp_path, record)
    with caplog.at_level(logging.WARNING):
        assert files.prune(tmp_path, 1, branch=ours) == []
    assert _names(tmp_path) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert "prunes nothing" in caplog.text
    assert not list(tmp_path.glob(".lineage*.tmp"))  # the per-process temporary was renamed into place
