"""FP8 on nn.MultiheadAttention: its in-projection (a bare in_proj_weight) and its out_proj run FP8
GEMMs through the forward built from its parts, with the numbers of Fp8Linears on the same weights;
parameters, names and the state dict stay as they were."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.fp8 import Fp8Linear, Fp8Recipe, advance_fp8_histories, convert_to_fp8, fp8_disabled
from lightning_5d.fp8.attention import convert_attention_to_fp8
from lightning_5d.fp8.convert import fp8_scaling_state
from lightning_5d.fp8.linear import Fp8Projection
from lightning_5d.fp8.targets import fp8_attention_targets, fp8_targets
from lightning_5d.plan import discover

E, H = 32, 4


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, E)
        layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 64)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


def _fp8_reference(mha: nn.MultiheadAttention, x: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """Self-attention with an Fp8Linear on the packed in-projection (same weights) and out_proj."""
    in_proj = Fp8Linear(E, 3 * E, recipe=recipe)
    in_proj.weight, in_proj.bias = mha.in_proj_weight, mha.in_proj_bias
    out_proj = mha.out_proj  # converted already
    q, k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in in_proj(x).chunk(3, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out_proj(out.transpose(1, 2).flatten(2))


def test_targets_hold_out_proj_and_the_in_projection_of_each_attention():
    model = Encoder()
    plan = discover(model)
    assert fp8_attention_targets(plan) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    linears = fp8_targets(plan, model)
    assert "encoder.layers.0.self_attn.out_proj" in linears and "encoder.layers.1.linear1" in linears


@pytest.mark.parametrize("recipe", [Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED])
def test_the_projections_run_fp8_with_fp8_linear_numbers(recipe):
    torch.manual_seed(0)
    model = Encoder()
    reference = copy.deepcopy(model)
    names = set(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    plan = discover(model)
    convert_to_fp8(model, fp8_targets(plan, model), recipe)
    assert convert_attention_to_fp8(model, fp8_attention_targets(plan), recipe) == [
        "encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.1.self_attn.in_proj_weight"]  # fmt: skip
    mha = model.encoder.layers[0].self_attn
    assert isinstance(mha.out_proj, Fp8Linear) and isinstance(mha.in_proj_weight_gemm, Fp8Projection)
    assert set(model.state_dict()) == names  # no new key: the GEMM holds no parameter
    assert all(p is params[n] for n, p in model.named_parameters())

    x = torch.randn(2, 6, E)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    got = mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, _fp8_reference(mha, x, recipe), rtol=0, atol=0)
    plain = reference.encoder.layers[0].self_attn(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert (got - plain).abs().max() > 1e-4  # FP8 rounding shows: the GEMMs did run in FP8
    torch.testing.assert_close(got, plain, rtol=0.1, atol=0.05)
    with fp8_disabled():  # the numerics guard's high-precision pass: torch's numbers
        ids = torch.randint(0, 64, (2, 6))
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-6, atol=1e-6)

    if recipe is Fp8Recipe.DELAYED:
        model(torch.randint(0, 64, (2, 6))).sum().backward()
        advance_fp8_histories(model)
        state = fp8_scaling_state(model)
        history = state["encoder.layers.0.self_attn.in_proj_weight_gemm"]
        assert history["input"][0] > 0 and history["weight"][0] > 0 and history["grad_output"][0] > 0


def test_converting_out_proj_alone_makes_the_attention_call_it():
    """torch's forward multiplies by out_proj.weight itself: an Fp8Linear there would never run."""
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    convert_to_fp8(mha, ["out_proj"], Fp8Recipe.TENSORWISE)
    calls = []
    mha.out_proj.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(1, 4, E)
    mha(x, x, x)
    assert calls == [1]


def test_a_path_that_is_not_multihead_attention_changes_nothing():
    model = Encoder()
    with pytest.raises(ValueError, match="'head' is a Linear, not nn.MultiheadAttention"):
        convert_attention_to_fp8(model, ["encoder.layers.0.self_attn", "head"], Fp8Recipe.TENSORWISE)
    assert "forward" not in vars(model.encoder.layers[0].self_attn)
