"""The sharded format's reading side: nothing unpickles code, and every broken file gets an error
that says what is wrong and leaves the files as they were."""

import hashlib
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_5d.checkpoint import CheckpointError, is_sharded_checkpoint, read_model_state
from lightning_5d.checkpoint import sharded
from lightning_5d.checkpoint.files import COMPLETE


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "step=3.ckpt"
    path.mkdir()
    tensors = {"model.w": torch.arange(12.0).reshape(3, 4), "model.b": torch.ones(4, dtype=torch.bfloat16)}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    sharded.write_extras(path, {"global_step": 3, "epoch": 0}, {"layout": {"tp": 1}, "contains": ["state_dict"]})
    return path


def _unstamped(path):
    """A COMPLETE marker as written before stamps: the deeper checks below are what is left then."""
    (path / COMPLETE).write_text("ok\n")


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_round_trip_consolidates_the_model(checkpoint):
    assert is_sharded_checkpoint(checkpoint)
    state = read_model_state(checkpoint)
    torch.testing.assert_close(state["w"], torch.arange(12.0).reshape(3, 4))
    assert state["b"].dtype == torch.bfloat16
    assert sharded.read_meta(checkpoint)["global_step"] == 3
    assert sharded.read_layout(checkpoint)["format"] == sharded.FORMAT_VERSION


def test_metadata_that_would_run_code_is_refused_without_running_it(checkpoint, tmp_path):
    witness = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    (checkpoint / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"damaged: .*\.metadata has"):  # the stamp sees the new file first
        read_model_state(checkpoint)
    _unstamped(checkpoint)
    before = _digest(checkpoint)
    with pytest.raises(CheckpointError, match="could not be read.*not allowed"):
        read_model_state(checkpoint)
    assert not witness.exists()
    assert _digest(checkpoint) == before


def test_a_truncated_data_file_gets_a_clear_error(checkpoint):
    data = next(checkpoint.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    before = _digest(checkpoint)
    with pytest.raises(CheckpointError, match=f"damaged: {data}.* bytes, .* were written"):
        read_model_state(checkpoint)
    _unstamped(checkpoint)  # without stamps DCP's byte ranges still name the short file
    with pytest.raises(CheckpointError, match=f"failed: {data} has .* bytes, the metadata says .* \\(truncated\\)"):
        read_model_state(checkpoint)
    assert {k: v for k, v in _digest(checkpoint).items() if k != COMPLETE} == {
        k: v for k, v in before.items() if k != COMPLETE
    }


def test_a_data_file_copied_in_from_another_step_is_refused(checkpoint, tmp_path):
    other = tmp_path / "step=1.ckpt"
    other.mkdir()
    tensors = {"model.w": torch.zeros(3, 4), "model.b": torch.zeros(4, dtype=torch.bfloat16)}  # same sizes
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(other)), no_dist=True)
    data = next(checkpoint.glob("*.distcp"))
    assert (other / data.name).stat().st_size == data.stat().st_size
    data.write_bytes((other / data.name).read_bytes())
    with pytest.raises(CheckpointError, match=f"damaged: {data} differs from the file written at save"):
        read_model_state(checkpoint)


def test_corrupt_metadata_gets_a_clear_error(checkpoint):
    (checkpoint / ".metadata").write_bytes(b"\x00not a pickle")
    _unstamped(checkpoint)
    with pytest.raises(CheckpointError, match="corrupt"):
        read_model_state(checkpoint)


def test_an_unfinished_checkpoint_points_at_latest(checkpoint):
    (checkpoint / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="incomplete.*latest_checkpoint"):
        read_model_state(checkpoint)


def test_a_missing_extra_file_is_reported_as_truncation(checkpoint):
    (checkpoint / sharded.META).unlink()
    with pytest.raises(CheckpointError, match="lacks meta.pt"):
        sharded.read_meta(checkpoint)


class Custom:
    """A user class in hyper-parameters: loading it would mean importing and running its code."""


def test_meta_is_read_without_pickled_code(checkpoint):
    torch.save({"hyper_parameters": Custom()}, checkpoint / sharded.META)
    _unstamped(checkpoint)
    with pytest.raises(CheckpointError, match="add_safe_globals"):
        sharded.read_meta(checkpoint)


def test_an_asynchronous_write_keeps_the_values_of_the_moment_it_was_started(tmp_path):
    weight = torch.ones(1000)
    future = sharded.write_tensors({"model.w": weight}, tmp_path, asynchronous=True)
    weight.fill_(7.0)  # the next optimizer step, while the writer thread may still be busy
    future.result()
    sharded.write_extras(tmp_path, {}, {})
    assert torch.equal(read_model_state(tmp_path)["w"], torch.ones(1000))


def test_regions_read_only_the_rank_piece_of_each_stored_tensor(tmp_path):
    """A tp rank's [q|k|v] chunks, a column cut and a 0-dim value, read straight into their outputs."""
    from lightning_5d.parallel.regions import FlatSlice, Region
    from lightning_5d.parallel.tensor.sharding import TensorShard

    qkv = torch.randn(48, 8)
    o = torch.randn(8, 16)
    step = torch.tensor(7.0)
    dcp.save({"qkv": qkv, "o": o, "step": step}, checkpoint_id=tmp_path, no_dist=True)
    shard = TensorShard(0, (32, 8, 8))
    whole = Region.whole(qkv.shape)
    qkv_region = whole.select(0, [(16, 32), (36, 40), (44, 48)])  # rank 1 of tp=2
    o_region = Region.whole(o.shape).select(1, [(8, 16)])
    flat, start = FlatSlice(20, 30).covering(Region.whole(o.shape))
    regions = {key: (r, torch.empty(r.local_shape)) for key, r in (("qkv", qkv_region), ("o", o_region))}
    regions["step"] = (Region.whole(()), torch.empty(()))
    sharded.read_regions(tmp_path, regions)
    assert torch.equal(regions["qkv"][1], shard.take(qkv, 1, 2))
    assert torch.equal(regions["o"][1], o[:, 8:])
    assert regions["step"][1] == 7
    rows = {"o": (flat, torch.empty(flat.local_shape))}
    sharded.read_regions(tmp_path, rows)
    assert torch.equal(rows["o"][1].reshape(-1)[start : start + 30], o.reshape(-1)[20:50])


def test_the_stored_model_state_reads_as_a_dict_in_load_hooks(checkpoint):
    # A user's on_load_checkpoint (or Lightning's WeightAveraging) reads checkpoint["state_dict"]
    # as a dict; before, the stand-in had no .items() (AttributeError inside the user's hook).
    from lightning_5d.checkpoint.strategy_reader import StoredModelState

    state = StoredModelState(checkpoint)
    assert sorted(state) == ["b", "w"] and len(state) == 2 and "w" in state and "model.w" not in state
    torch.testing.assert_close(state["w"], torch.arange(12.0).reshape(3, 4))
    assert state["b"].dtype == torch.bfloat16
    renamed = {f"net.{k}": v for k, v in state.items()}  # the replacement a hook may hand back
    torch.testing.assert_close(renamed["net.b"], torch.ones(4, dtype=torch.bfloat16))
    for change in (lambda: state.__setitem__("w", torch.zeros(3, 4)), lambda: state.pop("w"),
                   lambda: state.__delitem__("b"), lambda: state.update(w=1), lambda: state.setdefault("x")):  # fmt: skip
        with pytest.raises(CheckpointError, match=r"Replace it instead, e.g. checkpoint\['state_dict'\] = "):
            change()
    assert state.edited() is None  # read, not changed
    state["w"].mul_(0)  # an in-place change would be lost: the load refuses it
    assert "changed w of checkpoint['state_dict'] in place" in state.edited()


def test_a_key_check_reads_no_tensor(checkpoint, monkeypatch):
    from lightning_5d.checkpoint.strategy_reader import StoredModelState

    monkeypatch.setattr(sharded, "read_tensors_alone", lambda *a: pytest.fail("a key check read a tensor"))
    state = StoredModelState(checkpoint)
    assert "w" in state and "z" not in state and set(state.keys()) == {"w", "b"}
