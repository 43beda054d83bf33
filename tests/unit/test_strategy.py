"""Strategy construction and registration; everything that needs no process group."""

import lightning as L
import pytest

import lightning_5d
from lightning_5d import FiveDStrategy, LayoutError, ZeroStage


def trainer(strategy, devices):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False)


def test_5d_is_registered_and_leaves_the_layout_to_the_planner():
    t = trainer("5d", 2)
    assert isinstance(t.strategy, FiveDStrategy)
    assert t.strategy._plan_layout
    # Until setup, the fallback layout (data parallel, ZeRO-1) is what gets validated.
    assert t.strategy.zero_stage is ZeroStage.OPTIMIZER
    assert t.strategy.layout.dp_shard == 2 and t.strategy.layout.world_size == 2
    assert t.strategy.is_distributed


def test_any_explicit_size_or_stage_turns_the_planner_off():
    assert not FiveDStrategy(zero=2)._plan_layout
    assert not FiveDStrategy(dp_replicate=1)._plan_layout


def test_bad_layout_fails_when_the_trainer_is_built():
    with pytest.raises(LayoutError, match="does not match the world size 4"):
        trainer(FiveDStrategy(dp_shard=3), 4)


def test_expert_layout_that_does_not_divide_fails_when_the_trainer_is_built():
    with pytest.raises(LayoutError, match=r"ep=3 must divide dp_shard\*cp=4"):
        trainer(FiveDStrategy(ep=3), 4)


def test_from_config_mapping():
    s = FiveDStrategy.from_config({"dp_replicate": 2, "zero": 3})
    assert s.config.dp_replicate == 2 and s.zero_stage is ZeroStage.PARAMETERS


def test_public_api():
    assert {"FiveDStrategy", "ParallelConfig", "ZeroStage", "LayoutError"} <= set(lightning_5d.__all__)
