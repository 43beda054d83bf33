"""`l5d train` refuses expert-parallel layouts the model cannot take, before any worker starts."""

import pytest

from lightning_5d.config import LayoutError
from lightning_5d.train import compose, validate


def test_the_expert_recipe_validates():
    layout = validate(compose(["recipe=tiny_moe"]))
    assert (layout.ep, layout.dp_shard, layout.world_size) == (2, 2, 2)


def test_the_expert_recipe_at_four_ranks():
    assert validate(compose(["recipe=tiny_moe", "devices=4", "parallel.ep=4"])).ep == 4


def test_experts_that_do_not_split_over_ep():
    with pytest.raises(LayoutError, match=r"model.num_experts=6 does not split over parallel.ep=4") as err:
        validate(compose(["recipe=tiny_moe", "devices=4", "parallel.ep=4", "model.num_experts=6"]))
    # The valid values divide both the experts (6) and the borrowed ranks (dp_shard*cp=4).
    assert "dp_shard*cp=4): [1, 2]." in str(err.value)


def test_odd_expert_count_leaves_only_ep_1():
    with pytest.raises(LayoutError, match=r"model.num_experts=3 does not split over parallel.ep=2.*: \[1\]\."):
        validate(compose(["recipe=tiny_moe", "model.num_experts=3", "model.experts_top_k=1"]))


def test_ep_on_a_dense_model():
    with pytest.raises(LayoutError, match=r"parallel.ep=2 but the model has no experts \(model.num_experts=0\)") as err:
        validate(compose(["recipe=tiny_moe", "model=tiny"]))
    assert "Set model.num_experts" in str(err.value) and "parallel.ep=1" in str(err.value)


def test_ep_on_a_model_config_without_the_key():
    # A model config that leaves num_experts out gets the reference model's default: dense.
    with pytest.raises(LayoutError, match="the model has no experts"):
        validate(compose(["recipe=tiny_moe", "~model.num_experts"]))


def test_ep_that_does_not_divide_the_borrowed_ranks():
    with pytest.raises(LayoutError, match=r"ep=4 must divide dp_shard\*cp=2 .*valid ep values here: \[1, 2\]"):
        validate(compose(["recipe=tiny_moe", "parallel.ep=4"]))


def test_ep_with_sequence_parallel():
    with pytest.raises(LayoutError, match="sequence_parallel=true is not supported yet"):
        validate(compose(["recipe=tiny_moe", "devices=4", "parallel.tp=2", "parallel.sequence_parallel=true"]))


def test_ep_1_needs_no_experts():
    overrides = ["recipe=tiny_moe", "model=tiny", "parallel.ep=1", "parallel.expert.load_balancing=none"]
    assert validate(compose(overrides)).ep == 1


@pytest.mark.parametrize(
    "setting, shown",
    [
        ("parallel.expert.load_balancing=bias", "load_balancing=bias"),
        ("parallel.expert.capacity_factor=1.25", "load_balancing=aux_loss and capacity_factor=1.25"),
    ],
)
def test_balancing_or_capacity_on_a_dense_model(setting, shown):
    # They run the expert dispatch even at ep=1, so they need MoE layers too.
    with pytest.raises(LayoutError, match="act on MoE layers, but the model has no experts") as err:
        validate(compose(["recipe=tiny_moe", "model=tiny", "parallel.ep=1", setting]))
    assert f"parallel.expert.{shown}:" in str(err.value)
    assert "parallel.expert.load_balancing=none and parallel.expert.capacity_factor=null" in str(err.value)


def test_dense_model_is_not_checked_without_ep():
    assert validate(compose(["recipe=tiny_dp"])).ep == 1


def test_ep_with_tensor_parallel_without_sequence_parallel():
    layout = validate(compose(["recipe=tiny_moe", "devices=4", "parallel.tp=2"]))
    assert (layout.ep, layout.tp, layout.dp_shard) == (2, 2, 2)
