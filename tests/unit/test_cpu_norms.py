"""CPU norms under the precision plugin's forward: a float32 input into a bf16-weighted
LayerNorm / GroupNorm (a float32 buffer added to bf16 activations) computes in float32, as CUDA
autocast does, instead of failing; norms of one dtype are left as they were."""

import pytest
import torch
from torch import nn

from lightning_5d.cpu_norms import CpuNormsAsAutocast
from lightning_5d.precision import FiveDPrecision


def _norms():
    torch.manual_seed(0)
    return [nn.LayerNorm(8), nn.GroupNorm(2, 8)]


@pytest.mark.parametrize("index", [0, 1])
def test_mixed_input_and_weights_compute_in_float32(index):
    norm = _norms()[index]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 8) * 4 + 1
    reference = norm(x.float())  # float32 weights, float32 input
    norm.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="mixed dtype"):
        norm(x)  # what the plugin's forward hit before
    with torch.autocast("cpu", dtype=torch.bfloat16), CpuNormsAsAutocast():
        out = norm(x)
    assert out.dtype == torch.float32
    upcast = type(norm)(*([2] if index else []), 8)  # the bf16 weights, used in float32
    upcast.load_state_dict({k: v.float() for k, v in norm.state_dict().items()})
    torch.testing.assert_close(out, upcast(x))
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)  # bf16 weights vs float32 ones


def test_norms_of_one_dtype_and_other_ops_are_untouched():
    norm = _norms()[0].to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = norm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), CpuNormsAsAutocast():
        got = norm(x)
        assert (x @ x.T).dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_the_fp8_forward_context_on_cpu_runs_a_float32_buffer_into_a_bf16_layer_norm():
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8)).to(torch.bfloat16)
    table = torch.randn(4, 8)  # a float32 position buffer, as the user's module keeps it

    precision = FiveDPrecision("fp8")
    with precision.forward_context():
        out = model[1](model[0](torch.arange(4)) + table)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
