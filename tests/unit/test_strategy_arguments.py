"""Every FiveDStrategy argument (and key of its nested dicts) checked by one declarative schema.

Each invalid input must raise LayoutError at construction (before any process group) with a
message naming the field and its allowed values; valid spellings (members, values, names in any
case, as jsonargparse writes them) must be accepted. Settings the layout ignores warn once.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_5d import FiveDStrategy, LayoutError, ParallelConfig
from lightning_5d.checkpoint import CheckpointFormat, CheckpointWrite
from lightning_5d.config import (
    ActivationCheckpointing,
    ContextParallelMode,
    LoadBalancing,
    PipelineSchedule,
    ZeroStage,
)

NAN, INF = math.nan, math.inf
SIZES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")

# (field named in the message, keyword arguments)
INVALID: list[tuple[str, dict]] = [
    *[(size, {size: bad}) for size in SIZES for bad in (0, -1, True, 2.5, "two", [2])],
    *[(size, {size: "auto"}) for size in ("cp", "tp", "pp", "ep")],  # only data dims absorb the world
    *[("zero", {"zero": bad}) for bad in (4, -1, True, "four", 1.5, [1])],
    *[("activation_checkpointing", {"activation_checkpointing": bad}) for bad in ("some", 1, True, None)],
    *[("sequence_parallel", {"sequence_parallel": bad}) for bad in ("yes", 1, None)],
    *[("model_plan", {"model_plan": bad}) for bad in (["a"], {"layers.*": 1}, "layers.*")],
    *[
        ("rank_order", {"rank_order": bad})
        for bad in (
            ("tp", "dp_shard"),
            "pp",
            ("pp", "pp", "dp_shard", "cp", "tp"),
            ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"),
        )
    ],
    *[("bucket_size_mb", {"bucket_size_mb": bad}) for bad in (0, -1, NAN, INF, True, "abc")],
    *[("verify", {"verify": bad}) for bad in (True, "layers", 1)],
    *[
        (field, {"pipeline": bad})
        for field, bad in (
            ("pipeline", [1]),
            ("pipeline", "1f1b"),
            ("pipeline", {"steps": 3}),
            ("pipeline.schedule", {"schedule": "gpipe"}),
            ("pipeline.microbatches", {"microbatches": "a"}),
            ("pipeline.microbatches", {"microbatches": 0}),
            ("pipeline.microbatches", {"microbatches": True}),
            ("pipeline.microbatches", {"microbatches": 2.5}),
            ("pipeline.virtual_stages", {"virtual_stages": 0}),
            ("pipeline.virtual_stages", {"virtual_stages": None}),
            ("pipeline.balance", {"balance": "even"}),
            ("pipeline.stage_blocks", {"stage_blocks": [1, 0]}),
            ("pipeline.stage_blocks", {"stage_blocks": []}),
            ("pipeline.stage_blocks", {"stage_blocks": "2,2"}),
            ("pipeline.log_bubble", {"log_bubble": "yes"}),
            ("pipeline.log_bubble", {"log_bubble": 1}),
        )
    ],
    *[
        (field, {"context": bad})
        for field, bad in (
            ("context", [1]),
            ("context.mode", {"mode": "spiral"}),
            ("context.sharding", {"sharding": "spiral"}),
            ("context.ulysses", {"mode": "hybrid", "ulysses": 1}),
            ("context", {"ring": True}),
        )
    ],
    *[
        (field, {"expert": bad})
        for field, bad in (
            ("expert", (1, 2)),
            ("expert", {"capacity": 1.0}),
            ("expert.capacity_factor", {"capacity_factor": INF}),
            ("expert.capacity_factor", {"capacity_factor": 0}),
            ("expert.capacity_factor", {"capacity_factor": NAN}),
            ("expert.capacity_factor", {"capacity_factor": "abc"}),
            ("expert.drop_policy", {"drop_policy": "random"}),
            ("expert.load_balancing", {"load_balancing": "switch"}),
            ("expert.aux_loss_coef", {"aux_loss_coef": -1}),
            ("expert.aux_loss_coef", {"aux_loss_coef": NAN}),
            ("expert.bias_update_rate", {"bias_update_rate": -0.1}),
            ("expert.bias_update_rate", {"bias_update_rate": INF}),
            ("expert.log_load", {"log_load": "yes"}),
        )
    ],
    *[("checkpoint_format", {"checkpoint_format": bad}) for bad in ("zip", 1)],
    *[("checkpoint_write", {"checkpoint_write": bad}) for bad in ("later", True)],
    *[("keep_last_k", {"keep_last_k": bad}) for bad in (0, True, 1.5, "abc")],
    *[("pretrained", {"pretrained": bad}) for bad in (3, "")],
    ("pretrained_prefix", {"pretrained_prefix": 3}),
    *[("process_group_backend", {"process_group_backend": bad}) for bad in (3, "")],
    *[("timeout", {"timeout": bad}) for bad in ("abc", -1)],
    ("config", {"config": {"tp": 2}}),
]


def _id(case: tuple[str, dict]) -> str:
    return f"{case[0]}={list(case[1].values())[0]!r}"[:60]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[_id(c) for c in INVALID])
def test_invalid_argument_names_the_field_and_the_allowed_values(field, kwargs):
    # zero=1 keeps the planner off, so every argument is checked as given.
    kwargs = {"zero": 1, **kwargs}
    with pytest.raises(LayoutError) as err:
        FiveDStrategy(**kwargs)
    message = str(err.value)
    assert field in message, message
    assert "allowed:" in message or "valid keys are" in message, message


def test_the_table_covers_every_argument_and_nested_key():
    import inspect

    named = {field for field, _ in INVALID}
    arguments = set(inspect.signature(FiveDStrategy.__init__).parameters) - {"self", "kwargs"}
    assert arguments <= {f.split(".")[0] for f in named}
    for section in ("pipeline", "context", "expert"):
        keys = getattr(ParallelConfig(), section).__dataclass_fields__
        assert {f"{section}.{k}" for k in keys} <= named, section
    assert len(INVALID) >= 78


def test_every_error_is_listed_at_once():
    with pytest.raises(LayoutError) as err:
        FiveDStrategy(tp=0, pipeline={"microbatches": "a"}, expert={"aux_loss_coef": -1})
    assert "3 invalid settings" in str(err.value)
    for field in ("tp=0", "pipeline.microbatches='a'", "expert.aux_loss_coef=-1"):
        assert field in str(err.value)


@pytest.mark.parametrize(
    "kwargs,check",
    [
        ({}, lambda s: s.zero_stage is ZeroStage.OPTIMIZER and s._plan_layout),
        # What jsonargparse (LightningCLI) passes for the defaults: Enum names.
        (
            {"activation_checkpointing": "NONE", "checkpoint_format": "SHARDED", "checkpoint_write": "SYNC",
             "timeout": timedelta(minutes=30), "bucket_size_mb": 25.0, "sequence_parallel": False},
            lambda s: s.config.activation_checkpointing is ActivationCheckpointing.NONE
            and s.checkpoints.format is CheckpointFormat.SHARDED and s.checkpoints.write is CheckpointWrite.SYNC,
        ),
        ({"zero": 3}, lambda s: s.zero_stage is ZeroStage.PARAMETERS),
        ({"zero": "3"}, lambda s: s.zero_stage is ZeroStage.PARAMETERS),
        ({"zero": "PARAMETERS"}, lambda s: s.zero_stage is ZeroStage.PARAMETERS),
        ({"zero": "parameters"}, lambda s: s.zero_stage is ZeroStage.PARAMETERS),
        ({"zero": ZeroStage.GRADIENTS}, lambda s: s.zero_stage is ZeroStage.GRADIENTS),
        ({"activation_checkpointing": "Selective"}, lambda s: s.config.activation_checkpointing.value == "selective"),
        ({"activation_checkpointing": ActivationCheckpointing.FULL}, lambda s: s.config.activation_checkpointing == "full"),
        ({"pp": 2, "pipeline": {"schedule": "ONE_F_ONE_B", "microbatches": 4}},
         lambda s: s.config.pipeline.schedule is PipelineSchedule.ONE_F_ONE_B),
        ({"pp": 2, "pipeline": {"schedule": PipelineSchedule.AFAB}}, lambda s: s.config.pipeline.schedule == "afab"),
        ({"cp": 2, "context": {"mode": "RING", "sharding": "contiguous"}},
         lambda s: s.config.context.mode is ContextParallelMode.RING),
        ({"expert": {"load_balancing": "AUX_LOSS", "aux_loss_coef": 0.0, "capacity_factor": 1.25}},
         lambda s: s.config.expert.load_balancing is LoadBalancing.AUX_LOSS),
        ({"dp_replicate": "2", "dp_shard": "auto", "tp": 2}, lambda s: s.config.dp_replicate == 2),
        ({"rank_order": ["tp", "cp", "dp_shard", "dp_replicate", "pp"]}, lambda s: s.config.rank_order[0] == "tp"),
        ({"checkpoint_format": "full", "keep_last_k": 2}, lambda s: s.checkpoints.keep_last_k == 2),
        ({"pretrained": Path("w.safetensors"), "pretrained_prefix": "model."}, lambda s: s._pretrained == ("w.safetensors", "model.")),
        ({"model_plan": {"layers.*": "block"}}, lambda s: s.config.model_plan == {"layers.*": "block"}),
        ({"config": ParallelConfig(tp=2)}, lambda s: s.config.tp == 2),
    ],
)
def test_valid_spellings_are_accepted(kwargs, check):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these settings is ignored by its layout
        strategy = FiveDStrategy(**kwargs)
    assert check(strategy)


@pytest.mark.parametrize(
    "kwargs,names",
    [
        ({"dp_shard": "auto", "context": {"mode": "allgather"}}, ["context.mode", "cp=1"]),
        ({"zero": 1, "pipeline": {"microbatches": 8, "log_bubble": True}},
         ["pipeline.microbatches, pipeline.log_bubble", "pp=1"]),
        ({"zero": 1, "sequence_parallel": True}, ["sequence_parallel=True", "tp=1"]),
        ({"zero": 1, "expert": {"aux_loss_coef": 0.1}}, ["expert.aux_loss_coef", "load_balancing='aux_loss'"]),
        ({"zero": 3, "bucket_size_mb": 50}, ["bucket_size_mb"]),
        ({"zero": 1, "sequence_parallel": True, "context": {"sharding": "contiguous"}},
         ["context.sharding", "sequence_parallel=True"]),
    ],
)
def test_settings_the_layout_ignores_warn_once(kwargs, names):
    with pytest.warns(UserWarning) as record:
        FiveDStrategy(**kwargs)
    ours = [w for w in record if "have no effect" in str(w.message)]
    assert len(ours) == 1
    for name in names:
        assert name in str(ours[0].message)


def test_ignored_settings_warn_on_rank_zero_only(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FiveDStrategy(zero=1, sequence_parallel=True)


def test_no_warning_when_the_setting_counts_or_the_planner_decides():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FiveDStrategy(tp=2, sequence_parallel=True)
        FiveDStrategy(pp=2, pipeline={"schedule": "afab"})
        FiveDStrategy(sequence_parallel=True)  # no size given: the planner may choose tp > 1


def test_hydra_containers_are_read_like_dicts():
    """Hydra hands over DictConfig / ListConfig, nested ones included (a recipe's `parallel:`)."""
    from omegaconf import OmegaConf

    section = OmegaConf.create({"pp": 2, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2,
                                                      "stage_blocks": [1, 1, 1, 1]},
                                "context": {"mode": "ring"}, "model_plan": {"model.layers": "blocks"}})  # fmt: skip
    config = ParallelConfig.from_mapping(dict(section))
    assert config.pipeline.stage_blocks == [1, 1, 1, 1] and config.pipeline.virtual_stages == 2
    assert config.model_plan == {"model.layers": "blocks"}
    with pytest.raises(LayoutError, match="pipeline.virtual_stages"):
        ParallelConfig.from_mapping(dict(OmegaConf.create({"pipeline": {"virtual_stages": 0}})))


def test_numpy_integers_choose_enum_members_like_ints():
    """A sweep over np.arange hands numpy integers to every field, the ZeRO stage included."""
    np = pytest.importorskip("numpy")
    config = ParallelConfig(zero=np.int64(3), dp_shard=np.int64(2))
    assert int(config.zero) == 3 and config.dp_shard == 2
    with pytest.raises(LayoutError, match="zero"):
        ParallelConfig(zero=np.int64(7))
