import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_5d.checkpoint import CheckpointError, atomic_save, load_file


def test_atomic_save_leaves_no_partial_file(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save({"x": torch.ones(2)}, path, TorchCheckpointIO())
    assert path.is_file() and not list(tmp_path.glob(".*partial"))
    assert torch.equal(load_file(TorchCheckpointIO(), path)["x"], torch.ones(2))


def test_corrupt_checkpoint_gets_a_clear_error_and_stays_on_disk(tmp_path):
    path = tmp_path / "broken.ckpt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="(?s)could not be read.*resume from an earlier one"):
        load_file(TorchCheckpointIO(), path)
    assert path.read_bytes() == b"not a checkpoint"


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_file(TorchCheckpointIO(), tmp_path / "nope.ckpt")
