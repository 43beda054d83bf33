"""Publishing, `latest`, pruning: what a crash at any point leaves behind."""

from lightning_5d.checkpoint import files


def _complete(root, name):
    path = root / name
    path.mkdir()
    (path / files.COMPLETE).write_text("ok\n")
    return path


def test_publish_then_latest_names_the_new_checkpoint(tmp_path):
    old = _complete(tmp_path, "step=2.ckpt")
    files.update_latest(old)
    partial = files.partial_path(tmp_path / "step=4.ckpt")
    partial.mkdir()
    (partial / files.COMPLETE).write_text("ok\n")
    files.publish(partial, tmp_path / "step=4.ckpt")
    files.update_latest(tmp_path / "step=4.ckpt")
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=4.ckpt"
    assert not partial.exists()


def test_an_unfinished_save_leaves_latest_on_the_previous_checkpoint(tmp_path):
    old = _complete(tmp_path, "step=2.ckpt")
    files.update_latest(old)
    partial = files.partial_path(tmp_path / "step=4.ckpt")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")  # the writer was killed here
    assert files.latest_checkpoint(tmp_path) == old
    files.remove_stale_partials(tmp_path)
    assert not partial.exists() and old.exists()


def test_without_a_pointer_the_highest_complete_step_wins(tmp_path):
    _complete(tmp_path, "step=2.ckpt")
    _complete(tmp_path, "step=10.ckpt")
    (tmp_path / "step=12.ckpt").mkdir()  # no COMPLETE: never finished
    assert files.latest_checkpoint(tmp_path) == tmp_path / "step=10.ckpt"
    assert files.latest_checkpoint(tmp_path / "nothing") is None


def test_latest_never_moves_back_to_an_older_step(tmp_path):
    new, old = _complete(tmp_path, "step=8.ckpt"), _complete(tmp_path, "step=4.ckpt")
    files.update_latest(new)
    files.update_latest(old)  # an asynchronous save of an older step finishing late
    assert files.latest_checkpoint(tmp_path) == new


def test_republishing_a_name_replaces_it_only_once_the_new_one_is_complete(tmp_path):
    final = _complete(tmp_path, "last.ckpt")
    (final / "marker").write_text("old")
    partial = files.partial_path(final)
    partial.mkdir()
    (partial / files.COMPLETE).write_text("ok\n")
    files.publish(partial, final)
    assert not (final / "marker").exists() and (final / files.COMPLETE).exists()
    assert not any(p.name.endswith(".old") for p in tmp_path.iterdir())


def test_keep_last_k_prunes_the_oldest_steps_but_never_latest(tmp_path):
    paths = [_complete(tmp_path, f"step={s}.ckpt") for s in (2, 4, 6, 8)]
    (tmp_path / files.LATEST).write_text("step=4.ckpt\n")  # e.g. written by hand to resume from there
    removed = files.prune(tmp_path, keep_last_k=2)
    assert set(removed) == {paths[0]}
    assert {p.name for p in tmp_path.glob("*.ckpt")} == {"step=4.ckpt", "step=6.ckpt", "step=8.ckpt"}
