"""Checkpoint options: FiveDStrategy's keywords and `l5d train`'s `checkpoint:` keys, checked up front."""

import pytest

from lightning_5d import FiveDStrategy
from lightning_5d.checkpoint import CheckpointFormat, CheckpointWrite
from lightning_5d.train import ConfigError, compose, validate


def test_the_sharded_format_is_the_default():
    checkpoints = FiveDStrategy(zero=1).checkpoints
    assert checkpoints.format is CheckpointFormat.SHARDED and checkpoints.write is CheckpointWrite.SYNC


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"checkpoint_format": "zip"}, "checkpoint_format='zip' is not valid.*one of 'sharded', 'full'"),
        ({"checkpoint_write": "later"}, "checkpoint_write='later' is not valid.*one of 'sync', 'async'"),
        ({"keep_last_k": 0}, "keep_last_k=0 is not valid.*>= 1"),
        ({"checkpoint_format": "full", "checkpoint_write": "async"}, "async' needs checkpoint_format='sharded'"),
    ],
)
def test_bad_options_fail_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FiveDStrategy(zero=1, **kwargs)


def test_l5d_train_checks_the_checkpoint_keys_before_launch(tmp_path):
    validate(compose(["recipe=tiny_tp", "checkpoint.write=async", "checkpoint.keep_last_k=3"]))
    with pytest.raises(ConfigError, match="checkpoint: checkpoint_format='zip' is not valid"):
        validate(compose(["recipe=tiny_tp", "checkpoint.format=zip"]))
    with pytest.raises(ConfigError, match="unknown checkpoint option"):
        validate(compose(["recipe=tiny_tp", "+checkpoint.every=3"]))
    with pytest.raises(ConfigError, match="checkpoint.pretrained=.*does not exist"):
        validate(compose(["recipe=tiny_tp", f"checkpoint.pretrained={tmp_path / 'nope.safetensors'}"]))
