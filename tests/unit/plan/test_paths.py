"""Dotted paths and the `*` / `**` patterns of a model_plan."""

from lightning_5d.plan import paths


def test_single_star_is_one_component():
    pattern = paths.compile_pattern("model.layers.*.self_attn.q_proj")
    assert pattern.fullmatch("model.layers.11.self_attn.q_proj")
    assert not pattern.fullmatch("model.layers.1.inner.self_attn.q_proj")
    assert not pattern.fullmatch("model.layers.1.self_attn.q_proj.lora")


def test_double_star_is_any_number_of_components():
    pattern = paths.compile_pattern("**.q_proj")
    assert pattern.fullmatch("model.layers.3.self_attn.q_proj")
    assert not pattern.fullmatch("model.layers.3.self_attn.q_proj2")


def test_dots_are_literal():
    assert not paths.compile_pattern("a.b").fullmatch("axb")


def test_block_index():
    assert paths.block_index("model.layers.3.mlp.up", "model.layers") == (3, "mlp.up")
    assert paths.block_index("model.layers.3", "model.layers") == (3, "")
    assert paths.block_index("model.layers", "model.layers") is None
    assert paths.block_index("model.norm", "model.layers") is None
    assert paths.block_index("model.layers_x.3.mlp", "model.layers") is None


def test_common_parent_and_leaf():
    assert paths.common_parent(["mlp.gate", "mlp.up", "mlp.down"]) == "mlp"
    assert paths.common_parent(["attn.c_attn"]) == "attn"
    assert paths.common_parent(["q", "k"]) == ""
    assert paths.leaf("attn.to_out.0") == "to_out"
    assert paths.is_within("a.b.c", "a.b") and not paths.is_within("a.bc", "a.b")
    assert paths.is_within("anything", "")
