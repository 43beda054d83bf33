"""describe(): the plan as a table."""

from plan_models import ODD_PLAN, OddNet, hf_model, reference

from lightning_5d.plan import describe, discover


def test_reference_table():
    text = describe(reference(num_experts=4, num_shared_experts=1))
    assert text.startswith("Model plan (source: registry)")
    for expected in (
        "embedding           embed_tokens (vocab 256, hidden 32)",
        "blocks              layers (2 blocks)",
        "head                lm_head (untied)",
        "q=attention.q_proj [linear]",
        "4 (kv 2, head_dim 8)",
        "head attributes   num_heads, num_kv_heads",
        "kernel            sdpa",
        "experts           moe.experts (4 experts, module_list)",
        "top_k             2",
        "shared experts    moe.shared_experts",
        "norms               attention_norm, mlp_norm",
        "Block 1: same as block 0",
    ):
        assert expected in text, expected


def test_gpt2_table_shows_fused_segments_tied_head_positions():
    text = describe(hf_model("gpt2"))
    assert "qkv=attn.c_attn [conv1d, segments 64/64/64]" in text
    assert "o=attn.c_proj [conv1d]" in text
    assert "transformer.wpe" in text
    assert "lm_head (tied to the embedding)" in text


def test_describe_takes_a_plan_or_an_explicit_mapping():
    plan = discover(OddNet(), ODD_PLAN)
    assert describe(plan) == describe(OddNet(), ODD_PLAN)
    assert "Notes\n  - from structural source:" in describe(plan)


def test_differing_blocks_are_listed():
    model = reference(num_layers=3)
    model.layers[2] = reference(num_experts=4).layers[1]
    assert "Blocks that differ from block 0: 2" in describe(model)
