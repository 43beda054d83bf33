"""MasterWeights: fp32 copies step in place of bf16 parameters, and round back into them."""

import copy

import pytest
import torch
from torch import nn

from lightning_5d.parallel.data.master_weights import MasterWeights


def bf16_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)


def test_optimizer_steps_fp32_masters_and_model_gets_rounded_result():
    model = bf16_model()
    fp32_copy = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    masters = MasterWeights(opt)
    assert len(masters) == 4
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    grads = [p.grad.float().clone() for p in model.parameters()]
    masters.move_grads()
    assert all(p.grad is None for p in model.parameters())  # bf16 gradients freed as they move
    opt.step()
    for p, start, g, m in zip(model.parameters(), fp32_copy, grads, opt.param_groups[0]["params"]):
        expected = start - 1e-3 * g
        torch.testing.assert_close(m.detach(), expected)  # the update happened in fp32
        assert torch.equal(p.detach(), expected.to(torch.bfloat16))


def test_small_updates_accumulate_in_the_master_not_lost_to_bf16_rounding():
    p = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)
    masters = MasterWeights(opt)
    for _ in range(100):
        p.grad = torch.full((1,), 1e-4, dtype=torch.bfloat16)
        masters.move_grads()
        opt.step()
        opt.zero_grad()  # as Lightning does after each step: the masters' gradients start over
    # 1 - 100 * g, g = 1e-4 as bf16 holds it; stepping bf16 directly would stay at 1.0 (g < bf16's ulp at 1).
    g = torch.tensor(1e-4, dtype=torch.bfloat16).item()
    assert opt.param_groups[0]["params"][0].item() == pytest.approx(1 - 100 * g, abs=1e-6)
    assert p.item() == pytest.approx(0.99, abs=4e-3)


def test_fp32_parameters_are_left_to_the_optimizer():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterWeights(opt)
    assert len(masters) == 0
    assert opt.param_groups[0]["params"][0] is model.weight


def test_state_dict_is_keyed_by_model_parameters_inside_the_block_only():
    model = bf16_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    masters = MasterWeights(opt)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    masters.move_grads()
    opt.step()
    with masters.as_model_params():
        assert opt.param_groups[0]["params"][0] is model[0].weight
        assert model[0].weight in opt.state
        saved = opt.state_dict()
    assert opt.param_groups[0]["params"][0] is not model[0].weight
    assert masters.param_of(opt.param_groups[0]["params"][0]) is model[0].weight
    assert all(p.dtype == torch.float32 for p in opt.state)
    assert torch.is_tensor(saved["state"][0]["exp_avg"])


def test_refresh_copies_loaded_values_into_masters():
    model = bf16_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterWeights(opt)
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    masters.refresh()
    assert torch.equal(opt.param_groups[0]["params"][0], torch.full((8, 8), 0.5))


def test_refuses_an_optimizer_that_already_stepped():
    p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="before the optimizer's first step"):
        MasterWeights(opt)


def test_moving_after_every_micro_batch_sums_in_fp32():
    # bf16 holds 256 with an ulp of 2: adding 1.0 a hundred times in bf16 stays at 256.
    p = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)
    masters = MasterWeights(opt)
    for g in [256.0] + [1.0] * 100:
        p.grad = torch.full((1,), g, dtype=torch.bfloat16)
        masters.move_grads()
    assert opt.param_groups[0]["params"][0].grad.item() == 356.0
    bf16_sum = torch.zeros(1, dtype=torch.bfloat16)
    for g in [256.0] + [1.0] * 100:
        bf16_sum += g
    assert bf16_sum.item() == 256.0


def test_state_loaded_through_the_model_params_keeps_fp32_bits():
    model = bf16_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    masters = MasterWeights(opt)
    for _ in range(2):
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        masters.move_grads()
        opt.step()
        opt.zero_grad()
    with masters.as_model_params():
        saved = copy.deepcopy(opt.state_dict())
        assert model[0].weight.dtype == torch.float32  # shows the master's values for the block
    assert model[0].weight.dtype == torch.bfloat16
    fresh_model = bf16_model()
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=1e-3)
    fresh_masters = MasterWeights(fresh)
    with fresh_masters.as_model_params():
        fresh.load_state_dict(saved)
    for i, master in enumerate(fresh.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[master][key].dtype == torch.float32
            assert torch.equal(fresh.state[master][key], saved["state"][i][key])  # no trip through bf16


def test_a_frozen_parameter_gets_no_master():
    """A frozen bf16 weight in the optimizer (a fine-tuning's frozen base) would otherwise cost a
    full fp32 copy the optimizer never steps."""
    model = bf16_model()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    masters = MasterWeights(opt)
    assert len(masters) == 3 and masters.frozen == [model[0].weight]
    held = opt.param_groups[0]["params"]
    assert held[0] is model[0].weight and all(p.dtype == torch.float32 for p in held[1:])
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    masters.move_grads()
    before = model[0].weight.detach().clone()
    opt.step()
    assert torch.equal(model[0].weight, before) and not opt.state.get(model[0].weight)
