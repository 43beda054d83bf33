import pytest

from lightning_5d.config import (
    ActivationCheckpointing,
    LayoutError,
    ParallelConfig,
    PipelineSchedule,
    ZeroStage,
)


def test_auto_dp_shard_absorbs_the_world():
    layout = ParallelConfig().resolve(8)
    assert (layout.dp_replicate, layout.dp_shard, layout.world_size) == (1, 8, 8)


def test_hybrid_sharding_layout():
    layout = ParallelConfig(dp_replicate=2).resolve(8)
    assert (layout.dp_replicate, layout.dp_shard, layout.dp) == (2, 4, 8)


@pytest.mark.parametrize(
    "kwargs,world,needle",
    [
        (dict(dp_shard=3), 4, "product 3"),
        (dict(dp_replicate=3), 4, "not divisible by the fixed sizes' product 3"),
        (dict(dp_replicate=2, dp_shard=4), 4, "does not match the world size 4"),
    ],
)
def test_layout_that_does_not_divide_names_the_numbers(kwargs, world, needle):
    with pytest.raises(LayoutError, match=needle) as err:
        ParallelConfig(**kwargs).resolve(world)
    assert str(world) in str(err.value)


def test_ep_must_divide_the_ranks_it_borrows():
    with pytest.raises(LayoutError, match=r"ep=3 must divide dp_shard\*cp=4"):
        ParallelConfig(ep=3).resolve(4)


def test_ep_refuses_a_rank_order_that_puts_cp_before_dp_shard_and_names_one_that_works():
    """The expert groups read dp_replicate, dp_shard, cp in that order: with cp first a rank's place
    in its ep / edp_shard group would not be its rank in the group (tests/unit/dryrun/test_rank_mesh.py)."""
    order = ["tp", "cp", "pp", "dp_shard", "dp_replicate"]
    with pytest.raises(LayoutError, match=r"rank_order=\['tp', 'dp_replicate', 'pp', 'dp_shard', 'cp'\]") as err:
        ParallelConfig(cp=2, ep=4, rank_order=order).resolve(4)
    assert "ep=4" in str(err.value) and str(order) in str(err.value)
    fixed = ParallelConfig(cp=2, ep=4, rank_order=["tp", "dp_replicate", "pp", "dp_shard", "cp"]).resolve(4)
    assert fixed.ep == 4
    # Without ep, or where the expert lines still ascend (ep within cp, one rank per dp_shard line), accepted.
    ParallelConfig(cp=2, rank_order=order).resolve(4)
    ParallelConfig(cp=2, dp_shard=4, ep=2, rank_order=order).resolve(8)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(zero=4), "zero=4 is not valid"),
        (dict(activation_checkpointing="some"), "activation_checkpointing='some' is not valid"),
        (dict(tp=0), "tp=0 is not valid.*>= 1"),
        (dict(tp="two"), "tp=.two. is not valid.*integer"),
        (dict(rank_order=("tp", "dp_shard")), "rank_order"),
        (dict(pipeline={"schedule": "gpipe2"}), "pipeline.schedule='gpipe2'"),
        (dict(pipeline={"steps": 3}), r"Unknown key\(s\) \['steps'\] in `pipeline`"),
    ],
)
def test_bad_values_are_rejected_with_the_valid_choices(kwargs, needle):
    with pytest.raises(LayoutError, match=needle):
        ParallelConfig(**kwargs)


def test_from_mapping_coerces_strings_like_hydra_gives_them():
    cfg = ParallelConfig.from_mapping(
        {"zero": "3", "activation_checkpointing": "full", "pipeline": {"schedule": "interleaved_1f1b"}}
    )
    assert cfg.zero is ZeroStage.PARAMETERS
    assert cfg.activation_checkpointing is ActivationCheckpointing.FULL
    assert cfg.pipeline.schedule is PipelineSchedule.INTERLEAVED_1F1B
    with pytest.raises(LayoutError, match=r"Unknown key\(s\) \['zer'\]"):
        ParallelConfig.from_mapping({"zer": 1})


def test_rank_order_is_configurable():
    order = ("dp_replicate", "pp", "dp_shard", "tp", "cp")
    assert ParallelConfig(rank_order=order).resolve(2).rank_order == order


def test_context_sharding_is_an_enum_with_a_named_error():
    from lightning_5d.config import SequenceSharding

    assert ParallelConfig(cp=2, context={"sharding": "contiguous"}).context.sharding is SequenceSharding.CONTIGUOUS
    with pytest.raises(LayoutError, match="context.sharding"):
        ParallelConfig(context={"sharding": "spiral"})


# --------------------------------------------------------------------------- expert section


def test_expert_section_coerces_strings_to_enums():
    from lightning_5d.config import DropPolicy, ExpertConfig, LoadBalancing

    cfg = ParallelConfig(expert={"load_balancing": "aux_loss", "drop_policy": "position", "capacity_factor": 1.25})
    assert isinstance(cfg.expert, ExpertConfig)
    assert cfg.expert.load_balancing is LoadBalancing.AUX_LOSS
    assert cfg.expert.drop_policy is DropPolicy.POSITION
    assert cfg.expert.capacity_factor == 1.25
    default = ParallelConfig().expert
    assert default.capacity_factor is None
    assert default.load_balancing is LoadBalancing.NONE
    assert default.drop_policy is DropPolicy.PROBABILITY
    assert ParallelConfig(expert={"load_balancing": "bias"}).expert.load_balancing is LoadBalancing.BIAS


def test_expert_section_bad_values_are_rejected():
    with pytest.raises(LayoutError, match="expert.load_balancing='switch' is not valid") as err:
        ParallelConfig(expert={"load_balancing": "switch"})
    for choice in ("'none'", "'aux_loss'", "'bias'"):
        assert choice in str(err.value)
    with pytest.raises(LayoutError, match="expert.drop_policy='random'"):
        ParallelConfig(expert={"drop_policy": "random"})
    for bad in (0, -1.0):
        with pytest.raises(LayoutError, match="capacity_factor"):
            ParallelConfig(expert={"capacity_factor": bad})
    with pytest.raises(LayoutError, match=r"Unknown key\(s\) \['capacity'\] in `expert`"):
        ParallelConfig(expert={"capacity": 1.0})


def test_l5d_train_checks_the_parallel_section_with_the_same_schema():
    from lightning_5d.train import compose, validate

    with pytest.raises(LayoutError, match=r"pipeline\.microbatches='abc' is not valid.*allowed: an integer >= 1"):
        validate(compose(["recipe=tiny_tp", "parallel.pipeline.microbatches=abc"]))
    with pytest.raises(LayoutError, match=r"expert\.aux_loss_coef=-1 is not valid"):
        validate(compose(["recipe=tiny_tp", "parallel.expert.aux_loss_coef=-1"]))
