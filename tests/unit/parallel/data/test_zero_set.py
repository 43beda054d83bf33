"""Single-process checks of ZeroSet with duck-typed fake engines: flags, fan-out, the checks."""

import pytest
import torch

from lightning_5d.config import ZeroStage
from lightning_5d.parallel.data.zero_set import ZeroSet


class FakeEngine:
    def __init__(self, name, params=(), names=None, stage=ZeroStage.OPTIMIZER):
        self.name = name
        self.active, self.paused, self.require_sync = True, False, True
        self.stage = stage
        self.held = {id(p) for p in params}
        self.names = dict(names or {})
        self.calls = []

    def start_backward(self):
        self.calls.append("start_backward")

    def finish_gradient_sync(self):
        self.calls.append("finish_gradient_sync")

    def shard_optimizer(self, optimizer):
        self.calls.append(("shard_optimizer", optimizer))

    def refresh_masters(self):
        self.calls.append("refresh_masters")

    def master_names(self):
        return dict(self.names)

    def holds(self, p):
        return id(p) in self.held

    def name_of(self, p):
        return self.names[id(p)]

    def full_value(self, p, value):
        self.calls.append("full_value")
        return value * 10 if isinstance(value, torch.Tensor) and value.dim() else value  # "gathered"

    def local_value(self, p, value):
        self.calls.append("local_value")
        return value / 10 if isinstance(value, torch.Tensor) and value.dim() else value


def _two():
    dense = torch.nn.Parameter(torch.zeros(2, 3))
    expert = torch.nn.Parameter(torch.zeros(4))
    a = FakeEngine("dense", [dense], {id(dense): "layer.weight"}, stage=ZeroStage.GRADIENTS)
    b = FakeEngine("expert", [expert], {id(expert): "moe.experts.0.weight"})
    return dense, expert, a, b


@pytest.mark.parametrize("flag", ["active", "paused", "require_sync"])
def test_flags_propagate_to_every_engine(flag):
    _, _, a, b = _two()
    zs = ZeroSet([a, b])
    for value in (True, False, True):
        setattr(zs, flag, value)
        assert getattr(a, flag) is value and getattr(b, flag) is value
        assert getattr(zs, flag) is value
    setattr(a, flag, False)
    assert getattr(zs, flag) is False  # read from the first engine


def test_stage_is_the_first_engines():
    _, _, a, b = _two()
    assert ZeroSet([a, b]).stage is ZeroStage.GRADIENTS
    assert ZeroSet([b, a]).stage is ZeroStage.OPTIMIZER


def test_calls_fan_out_to_every_engine():
    dense, expert, a, b = _two()
    zs = ZeroSet([a, b])
    optimizer = torch.optim.SGD([dense, expert], lr=0.1)
    zs.start_backward()
    zs.finish_gradient_sync()
    zs.shard_optimizer(optimizer)
    zs.refresh_masters()
    for e in (a, b):
        assert e.calls == ["start_backward", "finish_gradient_sync", ("shard_optimizer", optimizer), "refresh_masters"]


def test_master_names_are_merged():
    dense, expert, a, b = _two()
    assert ZeroSet([a, b]).master_names() == {id(dense): "layer.weight", id(expert): "moe.experts.0.weight"}


def test_a_parameter_no_engine_holds_is_named_by_shape_before_any_sharding():
    dense, expert, a, b = _two()
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    optimizer = torch.optim.SGD([{"params": [dense, expert]}, {"params": [stray]}], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*not a parameter of the LightningModule"):
        ZeroSet([a, b]).shard_optimizer(optimizer)
    assert a.calls == [] and b.calls == []


def test_a_frozen_parameter_no_engine_holds_is_allowed():
    dense, expert, a, b = _two()
    frozen = torch.nn.Parameter(torch.zeros(3, 5), requires_grad=False)
    optimizer = torch.optim.SGD([dense, expert, frozen], lr=0.1)
    ZeroSet([a, b]).shard_optimizer(optimizer)
    assert a.calls == [("shard_optimizer", optimizer)] and b.calls == [("shard_optimizer", optimizer)]


def test_optimizer_state_round_trips_through_each_parameters_own_engine():
    dense, expert, a, b = _two()
    optimizer = torch.optim.SGD([dense, expert], lr=0.1, momentum=0.9)
    dense.grad, expert.grad = torch.ones_like(dense), torch.ones_like(expert)
    optimizer.step()
    full = ZeroSet([a, b]).full_optimizer_state(optimizer)
    assert set(full["state"]) == {"layer.weight", "moe.experts.0.weight"}
    assert full["param_groups"][0]["params"] == ["layer.weight", "moe.experts.0.weight"]
    torch.testing.assert_close(full["state"]["layer.weight"]["momentum_buffer"], torch.full((2, 3), 10.0))
    assert a.calls.count("full_value") == 1 and b.calls.count("full_value") == 1

    fresh = torch.optim.SGD([dense, expert], lr=0.1, momentum=0.9)
    ZeroSet([a, b]).load_full_optimizer_state(fresh, full)
    torch.testing.assert_close(fresh.state[expert]["momentum_buffer"], torch.ones(4))
    assert a.calls.count("local_value") == 1 and b.calls.count("local_value") == 1


def test_loading_state_for_an_unknown_parameter_is_refused():
    dense, expert, a, b = _two()
    optimizer = torch.optim.SGD([dense, expert], lr=0.1)
    state = {"state": {"ghost.weight": {}}, "param_groups": [{"params": ["ghost.weight"], "lr": 0.1}]}
    with pytest.raises(ValueError, match="unknown parameters"):
        ZeroSet([a, b]).load_full_optimizer_state(optimizer, state)
