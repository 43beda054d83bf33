"""The explicit model_plan: maps what nothing else can, wins where given, and every
way it can contradict itself or the model is an error naming the pattern."""

import pytest
import torch
from plan_models import ODD_PLAN, OddNet, Wrapper, hf_model, reference

from lightning_5d.plan import (
    AttentionKernel,
    ModelMappingError,
    PlanConflictError,
    PlanSource,
    Projection,
    discover,
)


def odd_net() -> OddNet:
    torch.manual_seed(0)
    return OddNet()


def test_odd_names_need_the_explicit_plan():
    with pytest.raises(ModelMappingError, match=r"no attention projections found in block stack\.0"):
        discover(odd_net())


def test_explicit_plan_maps_the_odd_model_and_the_tree_fills_the_rest():
    plan = discover(odd_net(), ODD_PLAN)
    assert plan.source is PlanSource.EXPLICIT
    att = plan.block_plans[0].attention
    assert att.path == "att"
    assert att.qkv == Projection("att.wa", segments=(48, 48, 48))
    assert att.o == Projection("att.wb")
    # heads=4 given, kv heads and head_dim follow from the fused width.
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 4, 12)
    assert att.kernel is AttentionKernel.EXPLICIT_SOFTMAX
    # Not named in the plan, found from the tree: the MLP (by its shapes), norms, ends.
    mlp = plan.block_plans[0].mlp
    assert (mlp.path, [p.path for p in mlp.column], [p.path for p in mlp.row]) == (
        "ff",
        ["ff.0"],
        ["ff.2"],
    )
    assert plan.block_plans[0].norms == ("pre", "post")
    assert (plan.embedding, plan.blocks, plan.final_norm, plan.head) == (
        "tok",
        "stack",
        "final",
        "out",
    )
    assert plan.num_blocks == 3
    assert any("structural" in note for note in plan.notes)


def test_explicit_paths_are_from_the_lightning_module():
    plan = discover(Wrapper(odd_net()), {f"model.{k}": v for k, v in ODD_PLAN.items()})
    assert plan.blocks == "model.stack" and plan.block_plans[0].attention.path == "att"


def test_double_star_spans_several_components():
    plan = discover(odd_net(), {**ODD_PLAN, "**.att.wb": "attention.o"})
    assert plan.block_plans[2].attention.o.path == "att.wb"


def test_explicit_wins_over_the_registry_where_given():
    plan = discover(reference(), {"layers.*.mlp_norm": "norm"})
    assert plan.source is PlanSource.EXPLICIT
    assert plan.block_plans[0].norms == ("mlp_norm",)
    # Everything it leaves out still comes from the registry.
    assert plan.block_plans[0].attention.q.path == "attention.q_proj"
    assert any("registry" in note for note in plan.notes)


def test_explicit_plan_of_one_part_on_a_published_model():
    model = hf_model("llama")
    plan = discover(model, {"model.layers.*.self_attn.o_proj": "attention.o"})
    assert plan.block_plans[0].attention.o.path == "self_attn.o_proj"
    assert plan.source is PlanSource.EXPLICIT


def test_explicit_module_cannot_take_a_second_role_from_a_later_source():
    # The user calls up_proj the row projection; the registry's "column" for it is dropped.
    plan = discover(
        reference(),
        {"layers.*.mlp.up_proj": "mlp.row", "layers.*.mlp.down_proj": "mlp.row"},
    )
    mlp = plan.block_plans[0].mlp
    assert [p.path for p in mlp.row] == ["mlp.up_proj", "mlp.down_proj"]
    assert [p.path for p in mlp.column] == ["mlp.gate_proj"]


def test_explicit_heads_that_agree_with_the_config_are_fine():
    plan = discover(reference(), {"layers.*.attention": "attention(heads=4, kv_heads=2)"})
    assert plan.block_plans[0].attention.num_kv_heads == 2


# ---------------------------------------------------------------- conflicts


def test_one_module_two_roles_names_both_patterns_and_the_module():
    bad = {**ODD_PLAN, "stack.*.att.w*": "attention.o"}
    with pytest.raises(PlanConflictError) as err:
        discover(odd_net(), bad)
    message = str(err.value)
    assert "'stack.0.att.wa'" in message
    assert "'stack.*.att.wa'" in message and "'stack.*.att.w*'" in message


def test_pattern_that_matches_nothing_suggests_names():
    with pytest.raises(PlanConflictError, match=r"'stack\.\*\.att\.wq'.*matches no module") as err:
        discover(odd_net(), {**ODD_PLAN, "stack.*.att.wq": "attention.q"})
    assert "stack.0.att" in str(err.value)  # a similar real name


def test_linear_role_on_a_norm_is_an_error():
    with pytest.raises(PlanConflictError, match=r"'stack\.0\.pre', a LayerNorm.*needs a linear layer"):
        discover(odd_net(), {**ODD_PLAN, "stack.*.pre": "mlp.column"})


def test_embedding_role_on_a_linear_is_an_error():
    with pytest.raises(PlanConflictError, match=r"'out'.*needs an nn.Embedding"):
        discover(odd_net(), {**ODD_PLAN, "out": "embedding"})


def test_heads_contradicting_the_model_config():
    with pytest.raises(PlanConflictError, match=r"heads=2 .*declares num_heads=4") as err:
        discover(reference(), {"layers.*.attention": "attention(heads=2)"})
    assert "'layers.*.attention'" in str(err.value)


def test_heads_contradicting_a_hf_config():
    model = hf_model("llama")
    with pytest.raises(PlanConflictError, match=r"kv_heads=4.*num_key_value_heads=2"):
        discover(model, {"model.layers.*.self_attn": "attention(kv_heads=4)"})


def test_block_role_outside_the_blocks():
    with pytest.raises(PlanConflictError, match=r"'final'.*not inside a block of 'stack'"):
        discover(odd_net(), {**ODD_PLAN, "final": "norm"})


def test_model_role_on_two_modules():
    with pytest.raises(PlanConflictError, match=r"'final_norm' is on two modules"):
        discover(odd_net(), {**ODD_PLAN, "final": "final_norm", "stack.0.pre": "final_norm"})


def test_single_role_on_two_modules_of_one_block():
    with pytest.raises(PlanConflictError, match=r"'attention.o' matches two modules in one block"):
        discover(
            odd_net(),
            {
                **ODD_PLAN,
                "stack.*.att.wb": "attention.o",
                "stack.*.ff.2": "attention.o",
            },
        )


def test_heads_that_do_not_divide_the_projection():
    plan = {**ODD_PLAN, "stack.*.att": "attention(heads=5)"}
    with pytest.raises(ModelMappingError) as err:
        discover(odd_net(), plan)
    message = str(err.value)
    assert "att.wa has 144 output features, which do not split into 5 + 2x5 heads" in message
    assert "model_plan:" in message  # with the snippet that fixes it


def test_head_counts_that_do_not_fill_the_fused_width():
    plan = {**ODD_PLAN, "stack.*.att": "attention(heads=6, kv_heads=4, head_dim=4)"}
    with pytest.raises(ModelMappingError, match=r"6 heads, 4 kv heads and head_dim 4 make 56"):
        discover(odd_net(), plan)


def test_kv_heads_that_do_not_divide_the_heads():
    plan = {**ODD_PLAN, "stack.*.att": "attention(heads=2, kv_heads=5)"}
    with pytest.raises(ModelMappingError, match=r"5 kv heads do not divide 2 query heads"):
        discover(odd_net(), plan)
