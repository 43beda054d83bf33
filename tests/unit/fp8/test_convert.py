"""Swapping nn.Linear for Fp8Linear keeps the very Parameter objects and only touches named paths."""

import pytest
import torch
from torch import nn

from lightning_5d.fp8 import Fp8Linear, Fp8Recipe, amax_histories, convert_to_fp8, fp8_linears


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16, bias=False)})

    def forward(self, x):
        return x + self.mlp["down"](torch.relu(self.mlp["up"](self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_from_linear_shares_parameters_mode_and_device():
    linear = nn.Linear(8, 4)
    linear.eval()
    fp8 = Fp8Linear.from_linear(linear, "rowwise")
    assert fp8.weight is linear.weight and fp8.bias is linear.bias
    assert fp8.recipe is Fp8Recipe.ROWWISE and not fp8.training
    assert (fp8.in_features, fp8.out_features) == (8, 4)
    assert fp8.weight.device == linear.weight.device
    no_bias = Fp8Linear.from_linear(nn.Linear(8, 4, bias=False), Fp8Recipe.DELAYED, amax_history_len=3)
    assert no_bias.bias is None and no_bias(torch.randn(2, 8)).shape == (2, 4)
    assert all(h.shape == (3,) for h in amax_histories(no_bias).values())
    assert "recipe=delayed" in repr(no_bias)
    with pytest.raises(TypeError, match="unknown Fp8Linear option"):
        Fp8Linear.from_linear(linear, Fp8Recipe.DELAYED, history=3)
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8Linear.from_linear(nn.LayerNorm(8), Fp8Recipe.TENSORWISE)


def test_convert_nested_module_in_place():
    model = Model()
    params_before = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the parameters from before conversion
    names = ["layers.0.mlp.up", "layers.0.mlp.down", "layers.1.mlp.up", "layers.1.mlp.down"]
    assert convert_to_fp8(model, names, Fp8Recipe.BLOCKWISE) == names
    assert sorted(fp8_linears(model)) == sorted(names)
    assert type(model.head) is nn.Linear and type(model.layers[0].norm) is nn.LayerNorm
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    # Converting again (with one new path) leaves converted layers alone and returns only the new one.
    up = model.layers[0].mlp["up"]
    assert convert_to_fp8(model, names + ["head"], Fp8Recipe.TENSORWISE) == ["head"]
    assert model.layers[0].mlp["up"] is up and up.recipe is Fp8Recipe.BLOCKWISE
    # The optimizer created before conversion still updates the converted layers.
    before = model.layers[1].mlp["down"].weight.detach().clone()
    model(torch.randn(3, 5, 16)).square().mean().backward()
    opt.step()
    assert not torch.equal(model.layers[1].mlp["down"].weight, before)


def test_convert_sequential_indices():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert convert_to_fp8(model, ["0", "2.0"], "mxfp8") == ["0", "2.0"]
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2][0], Fp8Linear)
    assert model(torch.randn(3, 4)).shape == (3, 2)


@pytest.mark.parametrize(
    ("path", "message"),
    [("layers.0.norm", "'layers.0.norm' is a LayerNorm"), ("layers.7.mlp.up", "'layers.7.mlp.up'"), ("", "root")],
)
def test_wrong_path_raises_and_changes_nothing(path, message):
    model = Model()
    with pytest.raises(ValueError, match=message):
        convert_to_fp8(model, ["head", path], Fp8Recipe.TENSORWISE)
    assert fp8_linears(model) == {}  # "head" was valid but nothing is converted on error
