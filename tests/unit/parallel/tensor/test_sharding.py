"""Single-process checks of TP sharding: TensorShard take/assemble, and the tp validation errors."""

import pytest
import torch

from lightning_5d.config import LayoutError
from lightning_5d.models.llama import LlamaConfig, LlamaModel
from lightning_5d.parallel.tensor.sharding import TensorShard
from lightning_5d.parallel.tensor.validate import TensorParallelError, validate_tensor_parallel
from lightning_5d.plan import discover


def _full(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(*shape)


# --------------------------------------------------------------------------- TensorShard


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_plain_cut_is_chunk_and_round_trips(dim, size):
    full = _full(8, 12)
    shard = TensorShard(dim)
    locals_ = [shard.take(full, r, size) for r in range(size)]
    for r, local in enumerate(locals_):
        assert torch.equal(local, full.chunk(size, dim=dim)[r])
        assert local.size(dim) == full.size(dim) // size
    assert torch.equal(shard.assemble(locals_), full)


def test_plain_cut_of_a_vector():  # biases (column: dim 0)
    full = _full(12)
    locals_ = [TensorShard(0).take(full, r, 3) for r in range(3)]
    assert [t.tolist() for t in locals_] == [list(range(4)), list(range(4, 8)), list(range(8, 12))]
    assert torch.equal(TensorShard(0).assemble(locals_), full)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize(
    "dim, segments",
    [
        (0, (8, 8, 8)),  # fused q|k|v of an nn.Linear (weight [out, in])
        (1, (8, 8, 8)),  # GPT-2 Conv1D c_attn (weight [in, out]): E, E, E
        (0, (16, 4, 4)),  # GQA fused qkv: H*d, KV*d, KV*d
        (1, (16, 4, 4)),
        (0, (12, 20)),  # fused gate|up of different widths
    ],
)
def test_fused_segments_cut_every_segment(dim, segments, size):
    shape = [6, 6]
    shape[dim] = sum(segments)
    full = _full(*shape)
    shard = TensorShard(dim, segments)
    locals_ = [shard.take(full, r, size) for r in range(size)]
    parts = full.split(segments, dim=dim)
    for r, local in enumerate(locals_):
        assert local.size(dim) == sum(segments) // size
        # rank r holds the r-th piece of each segment, in segment order
        pieces = local.split([s // size for s in segments], dim=dim)
        for piece, part in zip(pieces, parts):
            assert torch.equal(piece, part.chunk(size, dim=dim)[r])
    assert torch.equal(shard.assemble(locals_), full)


def test_fused_cut_differs_from_plain_cut():
    full = _full(24, 2)
    fused = TensorShard(0, (8, 8, 8)).take(full, 0, 2)
    plain = TensorShard(0).take(full, 0, 2)
    assert not torch.equal(fused, plain)
    # rank 0 of 2 holds rows 0-3 of q, 8-11 of k, 16-19 of v
    assert fused[:, 0].tolist() == [2.0 * i for i in [*range(4), *range(8, 12), *range(16, 20)]]


def test_fused_bias_round_trip():
    full = _full(16 + 4 + 4)
    shard = TensorShard(0, (16, 4, 4))
    locals_ = [shard.take(full, r, 4) for r in range(4)]
    assert [t.numel() for t in locals_] == [6] * 4
    assert torch.equal(shard.assemble(locals_), full)


def test_take_keeps_other_dims_and_dtype():
    full = torch.randn(4, 6, 8, dtype=torch.float32)
    local = TensorShard(2, (4, 4)).take(full, 1, 2)
    assert local.shape == (4, 6, 4) and local.dtype == torch.float32
    assert torch.equal(local, torch.cat([full[..., 2:4], full[..., 6:8]], dim=2))


def test_last_dim_as_negative_index():
    full = _full(3, 12)
    shard = TensorShard(-1, (4, 8))
    locals_ = [shard.take(full, r, 2) for r in range(2)]
    assert torch.equal(locals_[0], torch.cat([full[:, 0:2], full[:, 4:8]], dim=1))
    assert torch.equal(shard.assemble(locals_), full)


# --------------------------------------------------------------------------- validation

TINY = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_layers": 2,
    "num_heads": 6,
    "num_kv_heads": 6,
    "max_seq_len": 32,
}


def _model_and_plan(**overrides):
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(**{**TINY, **overrides}))
    return model, discover(model)


def test_errors_are_layout_errors():
    assert issubclass(TensorParallelError, LayoutError)


@pytest.mark.parametrize(
    "overrides", [{}, {"num_kv_heads": 2}, {"vocab_size": 250}, {"num_heads": 3, "num_kv_heads": 3}]
)
def test_tp1_always_passes(overrides):
    model, plan = _model_and_plan(**overrides)
    validate_tensor_parallel(plan, model, 1)


@pytest.mark.parametrize("tp", [2, 3, 6])
def test_dividing_tp_passes(tp):
    model, plan = _model_and_plan(vocab_size=240)  # 240 divides by 2, 3 and 6
    validate_tensor_parallel(plan, model, tp)


def test_num_heads_not_divisible():
    model, plan = _model_and_plan()  # 6 heads, 6 kv heads, vocab 256
    with pytest.raises(TensorParallelError) as info:
        validate_tensor_parallel(plan, model, 4)
    message = str(info.value)
    assert isinstance(info.value, LayoutError)
    assert "num_heads" in message and "=6" in message and "tp=4" in message
    assert "[2, 3, 6]" in message  # the tp values that would work


def test_tp_exceeds_kv_heads():
    model, plan = _model_and_plan(hidden_size=32, intermediate_size=64, num_heads=8, num_kv_heads=2)
    validate_tensor_parallel(plan, model, 2)
    for tp in (4, 8):
        with pytest.raises(TensorParallelError) as info:
            validate_tensor_parallel(plan, model, tp)
        message = str(info.value)
        assert isinstance(info.value, LayoutError)
        assert f"tp={tp}" in message and "2 key/value heads" in message
        assert "[1, 2]" in message


def test_vocab_size_not_divisible():
    model, plan = _model_and_plan(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=4, vocab_size=250)
    validate_tensor_parallel(plan, model, 2)
    with pytest.raises(TensorParallelError) as info:
        validate_tensor_parallel(plan, model, 4)
    message = str(info.value)
    assert "vocab_size=250" in message and "tp=4" in message
    assert "[2, 5, 10, 25, 50, 125, 250]" in message


def test_mlp_width_not_divisible():
    # heads and vocab divide by 2, the MLP's 90 output features by 2 too, but not by 4: tp=4
    # fails on the intermediate size, naming the projection
    model, plan = _model_and_plan(hidden_size=32, intermediate_size=90, num_heads=4, num_kv_heads=4)
    validate_tensor_parallel(plan, model, 2)
    with pytest.raises(TensorParallelError) as info:
        validate_tensor_parallel(plan, model, 4)
    assert "=90" in str(info.value) and "mlp" in str(info.value)


def test_validation_changes_nothing():
    model, plan = _model_and_plan()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TensorParallelError):
        validate_tensor_parallel(plan, model, 4)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
