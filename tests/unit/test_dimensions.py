"""The ordered steps that apply the dimensions (lightning_5d/dimensions.py), on one rank without
process groups: order, checks before applies, discovery only when a step reads the plan, re-entry."""

from types import SimpleNamespace

import pytest
from torch import nn

from lightning_5d.config import Layout, LayoutError, ParallelConfig
from lightning_5d.applied import AppliedDimensions
from lightning_5d.dimensions import STEPS, Step, apply_dimensions, combination_for


def test_the_steps_run_in_torchtitan_order():
    assert [s.name for s in STEPS] == [
        "prepare",
        "discover",
        "snapshot",
        "precision",
        "tensor",
        "expert",
        "context",
        "activation_checkpointing",
        "pipeline",
        "data",
        "verify",
    ]


class _Recorder(Step):
    def __init__(self, name: str, log: list, wanted: bool = True, needs_plan: bool = False, refuse: bool = False):
        self.name, self.log, self._wanted, self._needs_plan, self._refuse = name, log, wanted, needs_plan, refuse

    def wanted(self, ctx):
        return self._wanted

    def needs_plan(self, ctx):
        return self._needs_plan

    def check(self, ctx):
        self.log.append(f"check {self.name}")
        if self._refuse:
            raise LayoutError(f"{self.name} refused")

    def apply(self, ctx):
        self.log.append(f"apply {self.name} plan_needed={ctx.plan_needed}")


def _apply(steps):
    config = ParallelConfig()
    combination = combination_for(config, Layout(), None, loss_scaling=False)
    return apply_dimensions(nn.Linear(2, 2), config, SimpleNamespace(), None, combination, steps)


def test_every_active_step_checks_before_any_applies_and_inactive_steps_do_nothing():
    log: list[str] = []
    steps = [_Recorder("a", log), _Recorder("off", log, wanted=False), _Recorder("b", log, needs_plan=True)]
    _apply(steps)
    assert log == ["check a", "check b", "apply a plan_needed=True", "apply b plan_needed=True"]


def test_a_refusal_leaves_every_step_unapplied_and_an_inactive_step_needs_no_plan():
    log: list[str] = []
    steps = [_Recorder("a", log), _Recorder("off", log, wanted=False, needs_plan=True), _Recorder("b", log, refuse=True)]
    with pytest.raises(LayoutError, match="b refused"):
        _apply(steps)
    assert log == ["check a", "check b"]
    log.clear()
    _apply(steps[:2])
    assert log == ["check a", "apply a plan_needed=False"]


def test_the_same_module_again_reuses_the_dimensions_and_wakes_the_zero_engines():
    module = nn.Linear(2, 2)
    zero = SimpleNamespace(active=False)
    applied = AppliedDimensions(module=module, zero=zero)
    assert applied.already_applied(module) and zero.active
    assert not AppliedDimensions().already_applied(module)  # nothing applied yet


def test_another_module_is_refused_once_a_dimension_holds_state_of_the_first():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    assert not AppliedDimensions(module=first).already_applied(second)  # stateless: apply afresh
    for state in ({"zero": SimpleNamespace(active=True)}, {"fsdp_units": [object()]}, {"pp": object()}):
        with pytest.raises(LayoutError, match="another module"):
            AppliedDimensions(module=first, **state).already_applied(second)
