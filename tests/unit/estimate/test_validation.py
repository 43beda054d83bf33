"""Layouts that cannot be built are refused with the bad number and a valid alternative."""

import pytest

from lightning_5d.config import LayoutError
from lightning_5d.estimate import TrainingSetup, estimate, get_preset, validate

TINY = get_preset("l5d-tiny")  # 8 heads, 4 kv heads, 4 layers
MOE = get_preset("l5d-tiny-moe")  # 4 experts


@pytest.mark.parametrize(
    "spec, fields, gpus, pattern",
    [
        (TINY, dict(tp=16), None, r"tp=16 does not divide num_heads=8.*valid tp: \[1, 2, 4\]"),
        (TINY, dict(tp=3), None, r"tp=3 .*valid tp: \[1, 2, 4\]"),
        (TINY, dict(dp_shard=12, tp=8), 64, r"dp\*tp\*pp\*cp = 96 != gpus 64"),
        (
            TINY,
            dict(pp=3),
            None,
            r"pp\*v = 3\*1 = 3 does not divide num_layers=4; valid pp for v=1: \[1, 2, 4\]",
        ),
        (
            TINY,
            dict(pp=4, schedule="interleaved_1f1b", virtual_stages=2, microbatches=8),
            None,
            r"pp\*v = 4\*2 = 8 does not divide num_layers=4; valid pp for v=2: \[1, 2\]",
        ),
        (
            TINY,
            dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=3),
            None,
            r"microbatches=3 is not a multiple of pp=2.*\[2, 4, 6, 8\]",
        ),
        (
            TINY,
            dict(cp=3, seq_len=256),
            None,
            r"seq_len=256 is not divisible by 2\*cp = 6.*valid cp: \[1, 2, 4, 8\]",
        ),
        (TINY, dict(ep=2, dp_shard=2), None, r"ep=2 needs an MoE model"),
        (MOE, dict(ep=3, dp_shard=3), None, r"ep=3 does not divide num_experts=4"),
        (MOE, dict(ep=4, dp_shard=2), None, r"ep=4 must divide dp_shard\*cp = 2.*valid ep: \[1, 2\]"),
        (TINY, dict(schedule="zbv", virtual_stages=3, pp=2), None, r"virtual_stages=3.*V-shaped"),
    ],
)
def test_bad_layouts_name_value_and_fix(spec, fields, gpus, pattern):
    with pytest.raises(LayoutError, match=pattern):
        validate(spec, TrainingSetup(**fields), gpus)


def test_kv_heads_that_cannot_split_evenly():
    spec = TINY.replace(num_heads=12, num_kv_heads=4, hidden_size=192, intermediate_size=384)
    with pytest.raises(LayoutError, match=r"tp=3 does not divide num_kv_heads=4.*valid tp: \[1, 2, 4\]"):
        validate(spec, TrainingSetup(tp=3))
    # tp=12 would replicate each kv head 3 ways, which the runtime refuses (tensor.py)
    with pytest.raises(LayoutError, match=r"tp=12 does not divide num_kv_heads=4"):
        validate(spec, TrainingSetup(tp=12))
    validate(spec, TrainingSetup(tp=4))


def test_vocabulary_must_split_over_tp():
    spec = TINY.replace(vocab_size=255)
    with pytest.raises(LayoutError, match=r"tp=2 does not divide vocab_size=255"):
        validate(spec, TrainingSetup(tp=2))


@pytest.mark.parametrize(
    "fields, pattern",
    [
        (dict(tp=0), r"tp=0 must be an integer >= 1"),
        (dict(zero=5), r"zero=5 is not valid"),
        (dict(schedule="gpipe"), r"schedule='gpipe' is not valid; choose one of .*'1f1b'"),
        (dict(recompute="some"), r"recompute='some' is not valid"),
        (dict(precision="int4"), r"precision='int4' is not valid; choose one of 'bf16', 'fp32', 'fp8'"),
    ],
)
def test_bad_fields_are_layout_errors(fields, pattern):
    with pytest.raises(LayoutError, match=pattern):
        TrainingSetup(**fields)


def test_lightning_precision_strings_are_accepted():
    assert TrainingSetup(precision="bf16-mixed").precision.value == "bf16"
    assert TrainingSetup(precision="32-true").precision.value == "fp32"


def test_estimate_validates_before_computing():
    with pytest.raises(LayoutError, match="gpus 8"):
        estimate("l5d-tiny", tp=2, dp_shard=2, gpus=8)
    assert estimate("l5d-tiny", tp=2, dp_shard=4, gpus=8).setup.world_size == 8
