"""Strategy construction and registration; everything that needs no process group."""

import lightning as L
import pytest

import lightning_5d
from lightning_5d import DimensionNotAvailableError, FiveDStrategy, LayoutError, ZeroStage


def trainer(strategy, devices):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False)


def test_5d_is_registered_and_defaults_to_zero1_data_parallel():
    t = trainer("5d", 2)
    assert isinstance(t.strategy, FiveDStrategy)
    assert t.strategy.zero_stage is ZeroStage.OPTIMIZER
    assert t.strategy.layout.dp_shard == 2 and t.strategy.layout.world_size == 2
    assert t.strategy.is_distributed


def test_bad_layout_fails_when_the_trainer_is_built():
    with pytest.raises(LayoutError, match="does not match the world size 4"):
        trainer(FiveDStrategy(dp_shard=3), 4)


def test_unavailable_dimension_fails_in_the_constructor():
    with pytest.raises(DimensionNotAvailableError, match="tp=2"):
        FiveDStrategy(tp=2)


def test_from_config_mapping():
    s = FiveDStrategy.from_config({"dp_replicate": 2, "zero": 3})
    assert s.config.dp_replicate == 2 and s.zero_stage is ZeroStage.PARAMETERS


def test_public_api():
    assert {"FiveDStrategy", "ParallelConfig", "ZeroStage", "LayoutError"} <= set(lightning_5d.__all__)
