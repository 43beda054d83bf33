"""Fp8Linear against an fp32 nn.Linear, per recipe: forward, the three GEMMs, delayed scaling,
fp8_disabled, dtypes, and a short training run.

Error bounds (norm-relative, ``||out - ref|| / ||ref||``): rounding errors of independent
operands add in quadrature, and the round trip of N(0, 1) data costs ~0.026 (E4M3) / ~0.05 (E5M2)
in that measure (see test_quantize). A GEMM of two E4M3 operands is then expected near
sqrt(2) * 0.026 ~ 0.037 (measured 0.036-0.039), one of E5M2 x E4M3 near 0.058 (measured 0.058).
Bounds: 0.05 for all-E4M3 GEMMs (forward always, and every GEMM of blockwise / mxfp8), 0.1 for
GEMMs with an E5M2 gradient operand.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.fp8 import (
    E4M3,
    Fp8Linear,
    Fp8Recipe,
    amax_histories,
    convert_to_fp8,
    fp8_disabled,
    fp8_gemm,
    quantize_tensorwise,
    relative_error,
)
from lightning_5d.fp8.convert import advance_fp8_histories, fp8_scaling_state, load_fp8_scaling_state

RECIPES = list(Fp8Recipe)
ALL_E4M3 = {Fp8Recipe.BLOCKWISE, Fp8Recipe.MXFP8}


def linear_pair(in_features=300, out_features=200, seed=0, **kwargs):
    torch.manual_seed(seed)
    ref = nn.Linear(in_features, out_features)
    return ref, copy.deepcopy(ref)


def forward_backward(module, x, dy):
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone()


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_three_gradients_close_to_fp32(recipe):
    # K=300, N=200, 200 tokens: not multiples of 128 or 32, so edge tiles/blocks are partial.
    ref, base = linear_pair()
    fp8 = Fp8Linear.from_linear(base, recipe)
    torch.manual_seed(1)
    x, dy = torch.randn(4, 50, 300), torch.randn(4, 50, 200)
    y_ref, dx_ref, dw_ref, db_ref = forward_backward(ref, x, dy)
    y, dx, dw, db = forward_backward(fp8, x, dy)
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    errors = {"y": relative_error(y, y_ref), "dx": relative_error(dx, dx_ref), "dw": relative_error(dw, dw_ref)}
    assert errors["y"] < 0.05, errors
    grad_bound = 0.05 if recipe in ALL_E4M3 else 0.1
    assert errors["dx"] < grad_bound and errors["dw"] < grad_bound, errors
    # The bias gradient is a plain sum of dy, not an FP8 GEMM.
    torch.testing.assert_close(db, db_ref)
    assert dx.dtype == x.dtype and dw.dtype == base.weight.dtype


@pytest.mark.parametrize("recipe", [Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED, Fp8Recipe.ROWWISE])
def test_scaled_mm_agrees_with_emulation(recipe, monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs["scale_a"].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    _, base = linear_pair(seed=2)
    torch.manual_seed(3)
    x, dy = torch.randn(2, 64, 300), torch.randn(2, 64, 200)
    fast = forward_backward(Fp8Linear.from_linear(base, recipe, use_scaled_mm=True), x, dy)
    assert len(calls) == 3, "fprop, dgrad and wgrad should all go through _scaled_mm"
    n_calls = len(calls)
    emulated = forward_backward(Fp8Linear.from_linear(base, recipe, use_scaled_mm=False), x, dy)
    assert len(calls) == n_calls
    # Same FP8 operands, both fp32-accumulated: only fp32 rounding differs (dequantizing by
    # dividing by the scale vs _scaled_mm multiplying by its reciprocal, summation order).
    for a, b in zip(fast, emulated):
        assert relative_error(a, b) < 1e-5


def test_rowwise_scaled_mm_uses_row_scales():
    # Rowwise GEMMs hand _scaled_mm (M, 1) and (1, N) dequantization scales.
    from lightning_5d.fp8 import quantize_rowwise

    torch.manual_seed(0)
    a, b = torch.randn(48, 80), torch.randn(24, 80)
    qa, qb = quantize_rowwise(a, E4M3), quantize_rowwise(b, E4M3)
    out = fp8_gemm(qa, qb, torch.float32, use_scaled_mm=True)
    emulated = fp8_gemm(qa, qb, torch.float32, use_scaled_mm=False)
    assert relative_error(out, emulated) < 1e-6
    assert relative_error(out, a @ b.t()) < 0.05


def test_leading_dims_and_matmul_no_bias():
    _, base = linear_pair(64, 48)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.TENSORWISE)
    x = torch.randn(2, 3, 5, 64)
    y = fp8(x)
    assert y.shape == (2, 3, 5, 48)
    assert torch.equal(fp8.matmul_no_bias(x) + fp8.bias, y)
    assert fp8(torch.randn(64)).shape == (48,)


def test_forward_uses_the_weight_present_at_call_time():
    # Tensor parallelism replaces the weight with a local shard and rewrites the feature counts.
    _, base = linear_pair(64, 48)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.BLOCKWISE)
    fp8.weight = nn.Parameter(base.weight.detach()[:24, :32].clone())
    fp8.bias = nn.Parameter(base.bias.detach()[:24].clone())
    x = torch.randn(10, 32)
    y = fp8(x)
    assert y.shape == (10, 24)
    assert relative_error(y, F.linear(x, fp8.weight, fp8.bias)) < 0.05
    with pytest.raises(ValueError, match="features"):
        fp8(torch.randn(10, 64))


def test_fp8_disabled_is_exactly_f_linear_and_leaves_histories_alone():
    _, base = linear_pair(64, 48)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.DELAYED)
    fp8(torch.randn(8, 64)).sum().backward()  # one FP8 step, so the histories are non-trivial
    before = {k: v.clone() for k, v in amax_histories(fp8).items()}
    x = torch.randn(8, 64, requires_grad=True)
    with fp8_disabled():
        with fp8_disabled():  # nesting must not re-enable FP8 on exit from the inner one
            pass
        y = fp8(x)
        y_nb = fp8.matmul_no_bias(x)
        y.sum().backward()
    assert torch.equal(y, F.linear(x, fp8.weight, fp8.bias))
    assert torch.equal(y_nb, F.linear(x, fp8.weight))
    for role, hist in amax_histories(fp8).items():
        assert torch.equal(hist, before[role]), role
    # And FP8 is back afterwards.
    assert not torch.equal(fp8(x), F.linear(x, fp8.weight, fp8.bias))


def test_output_dtype_follows_autocast_else_input():
    _, base = linear_pair(64, 48)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.ROWWISE)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32
    assert fp8.bias.grad.dtype == torch.float32
    # bf16 weights and inputs, no autocast: bf16 out, bf16 gradients.
    bf16 = Fp8Linear.from_linear(copy.deepcopy(base).to(torch.bfloat16), Fp8Recipe.MXFP8)
    xb = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    yb = bf16(xb)
    assert yb.dtype == torch.bfloat16
    yb.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and bf16.weight.grad.dtype == torch.bfloat16
    # A sanity bound only (accuracy is tested above): 192 outputs of K=64 average few roundings,
    # and MX saturates the top of some blocks (up to 12.5% on those elements).
    assert relative_error(yb, F.linear(xb, bf16.weight, bf16.bias)) < 0.1
    # fp32 module, fp32 input, no autocast: fp32.
    assert fp8(x).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Delayed scaling
# ---------------------------------------------------------------------------------------------


def step(module, x):
    y = module(x)
    y.sum().backward()
    advance_fp8_histories(module)  # as FiveDPrecision does after each optimizer step
    return y.detach()


def test_delayed_history_shifts_and_is_configurable():
    _, base = linear_pair(16, 8)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.DELAYED, amax_history_len=4)
    hist = amax_histories(fp8)
    assert set(hist) == {"input", "weight", "grad_output"}
    assert all(h.shape == (4,) and h.dtype == torch.float32 and not h.any() for h in hist.values())
    amaxes = [1.0, 3.0, 2.0, 5.0, 0.5]
    for a in amaxes:
        x = torch.zeros(2, 16)
        x[0, 0] = a
        step(fp8, x)
    # Newest first; the oldest (1.0) has fallen off the end of a length-4 history.
    assert hist["input"].tolist() == [0.5, 5.0, 2.0, 3.0]
    w_amax = base.weight.abs().max().item()
    assert hist["weight"].tolist() == pytest.approx([w_amax] * 4)
    # dy of y.sum() is all ones.
    assert hist["grad_output"].tolist() == [1.0] * 4


def test_delayed_first_step_uses_the_current_amax():
    _, base = linear_pair(64, 48)
    torch.manual_seed(5)
    x = torch.randn(8, 64)
    delayed = forward_backward(Fp8Linear.from_linear(base, Fp8Recipe.DELAYED), x, torch.randn(8, 48))
    torch.manual_seed(5)
    x = torch.randn(8, 64)
    current = forward_backward(Fp8Linear.from_linear(base, Fp8Recipe.TENSORWISE), x, torch.randn(8, 48))
    for a, b in zip(delayed, current):
        assert torch.equal(a, b)


def test_delayed_later_steps_use_the_history_max():
    _, base = linear_pair(64, 48)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.DELAYED, use_scaled_mm=False)
    torch.manual_seed(6)
    big, small = 10 * torch.randn(8, 64), torch.randn(8, 64)
    step(fp8, big)
    y = step(fp8, small)
    qx = quantize_tensorwise(small, E4M3, amax=big.abs().max())
    qw = quantize_tensorwise(fp8.weight, E4M3, amax=fp8.weight.abs().max())
    expected = fp8_gemm(qx, qw, torch.float32, use_scaled_mm=False) + fp8.bias
    assert torch.equal(y, expected)
    # ... which is not what current scaling of `small` gives.
    assert not torch.equal(y, fp8_gemm(quantize_tensorwise(small, E4M3), qw, torch.float32) + fp8.bias)


def test_delayed_values_above_the_history_amax_saturate():
    fp8 = Fp8Linear(4, 4, bias=False, recipe=Fp8Recipe.DELAYED)
    with torch.no_grad():
        fp8.weight.copy_(torch.eye(4))
    step(fp8, torch.tensor([[1.0, 0.5, 0.25, -1.0]]))
    y = step(fp8, torch.tensor([[100.0, 0.5, 0.25, -1e30]]))
    assert torch.isfinite(y).all()
    # With W = I the output is the dequantized input: clamped at the history's amax of 1. Exact when
    # dequantized in fp32 (x / scale); torch._scaled_mm, on CPUs whose oneDNN runs it (AMX /
    # AVX512-FP16), multiplies by the reciprocal scales instead: within an ulp or two of it.
    torch.testing.assert_close(y, torch.tensor([[1.0, 0.5, 0.25, -1.0]]), rtol=2**-21, atol=0)


def test_delayed_histories_travel_beside_the_state_dict_and_restore():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    convert_to_fp8(model, ["0", "2"], Fp8Recipe.DELAYED, amax_history_len=8)
    for _ in range(3):
        step(model, torch.randn(5, 16))
    # Not in the module's state_dict: an FP8 run's checkpoint loads strictly into the plain model.
    assert not any("amax" in key for key in model.state_dict())
    nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).load_state_dict(model.state_dict())
    scaling = fp8_scaling_state(model)
    for prefix in ("0", "2"):
        for role in ("input", "weight", "grad_output"):
            assert scaling[prefix][role].shape == (8,) and scaling[prefix][role][:3].gt(0).all()
    fresh = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    convert_to_fp8(fresh, ["0", "2"], Fp8Recipe.DELAYED, amax_history_len=8)
    fresh.load_state_dict(model.state_dict())
    load_fp8_scaling_state(fresh, scaling)
    x = torch.randn(5, 16)
    assert torch.equal(fresh(x), model(x))


def test_delayed_scale_is_fixed_within_a_step_so_a_recompute_matches_its_forward():
    _, base = linear_pair(16, 8)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.DELAYED)
    step(fp8, torch.randn(3, 16))
    x = 10 * torch.randn(3, 16)
    first, again = fp8(x), fp8(x)  # a forward and its activation-checkpoint recompute
    assert torch.equal(first, again)
    before = amax_histories(fp8)["input"].clone()
    advance_fp8_histories(fp8)
    assert amax_histories(fp8)["input"][0] == x.abs().max() and torch.equal(
        amax_histories(fp8)["input"][1:], before[:-1]
    )


def test_delayed_eval_mode_does_not_update_histories():
    _, base = linear_pair(16, 8)
    fp8 = Fp8Linear.from_linear(base, Fp8Recipe.DELAYED)
    step(fp8, torch.randn(3, 16))
    before = {k: v.clone() for k, v in amax_histories(fp8).items()}
    fp8.eval()
    step(fp8, 100 * torch.randn(3, 16))
    assert all(torch.equal(v, before[k]) for k, v in amax_histories(fp8).items())


# ---------------------------------------------------------------------------------------------
# Training smoke test
# ---------------------------------------------------------------------------------------------


def train_mlp(recipe, steps=30):
    torch.manual_seed(1)
    data = torch.randn(512, 64)
    teacher = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16))
    with torch.no_grad():
        target = teacher(data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))
    if recipe is not None:
        assert convert_to_fp8(model, ["0", "2"], recipe) == ["0", "2"]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.no_grad():
        initial = F.mse_loss(model(data), target).item()
    for i in range(steps):
        batch = slice((64 * i) % 512, (64 * i) % 512 + 64)
        loss = F.mse_loss(model(data[batch]), target[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return initial, F.mse_loss(model(data), target).item()


def test_mlp_trains_in_fp8_like_in_fp32():
    initial, fp32 = train_mlp(None)
    assert fp32 < initial / 10  # the run really learns (measured 0.127 -> 0.0073)
    for recipe in RECIPES:
        _, final = train_mlp(recipe)
        # measured (FP8 forward in eval): 1.0-2.1% above fp32 for every recipe
        assert abs(final - fp32) <= 0.05 * fp32, (recipe, final, fp32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_empty_batch(recipe):
    # An expert that received no tokens still runs its linears.
    fp8 = Fp8Linear(40, 24, recipe=recipe)
    x = torch.randn(0, 40, requires_grad=True)
    y = fp8(x)
    y.sum().backward()
    assert y.shape == (0, 24) and x.grad.shape == (0, 40)
    assert not fp8.weight.grad.any()
