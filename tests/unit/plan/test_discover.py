"""discover() on the models it must map: the reference Llama (dense, MoE, wrapped) and
Hugging Face Llama, Qwen2 and GPT-2, bare and inside a LightningModule."""

import dataclasses

import pytest
from plan_models import MetaTransformer, Wrapper, hf_model, reference

from lightning_5d.models import LlamaLM
from lightning_5d.plan import (
    AttentionKernel,
    ModelPlan,
    PlanSource,
    Projection,
    ProjectionKind,
    discover,
)

TINY_LM = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
}


def without_provenance(plan: ModelPlan) -> ModelPlan:
    return dataclasses.replace(plan, source=PlanSource.STRUCTURAL, notes=())


def test_reference_dense():
    plan = discover(reference())
    assert plan.source is PlanSource.REGISTRY
    assert (plan.embedding, plan.blocks, plan.final_norm, plan.head) == (
        "embed_tokens",
        "layers",
        "norm",
        "lm_head",
    )
    assert (plan.vocab_size, plan.hidden_size, plan.num_blocks) == (256, 32, 2)
    assert plan.position_embedding is None and not plan.tied_head
    block = plan.block_plans[0]
    att = block.attention
    assert att.path == "attention"
    assert (att.q, att.k, att.v, att.o) == (
        Projection("attention.q_proj"),
        Projection("attention.k_proj"),
        Projection("attention.v_proj"),
        Projection("attention.o_proj"),
    )
    assert att.qkv is None
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 2, 8)
    assert att.head_attributes == ("num_heads", "num_kv_heads")
    assert att.kernel is AttentionKernel.SDPA
    assert block.mlp.path == "mlp"
    assert [p.path for p in block.mlp.column] == ["mlp.gate_proj", "mlp.up_proj"]
    assert [p.path for p in block.mlp.row] == ["mlp.down_proj"]
    assert block.moe is None and not plan.has_moe
    assert block.norms == ("attention_norm", "mlp_norm")
    assert plan.block_plans[1] == block


def test_reference_moe_with_shared_experts():
    plan = discover(reference(num_experts=4, num_shared_experts=1))
    block = plan.block_plans[0]
    assert block.mlp is None and plan.has_moe
    assert block.moe.path == "moe"
    assert (block.moe.router, block.moe.experts, block.moe.shared_experts) == (
        "moe.router",
        "moe.experts",
        "moe.shared_experts",
    )
    assert block.moe.num_experts == 4
    # The experts' own gate/up/down layers are the MoE's, not a block MLP.
    assert block.norms == ("attention_norm", "mlp_norm")


def test_reference_tied_embeddings():
    plan = discover(reference(tie_embeddings=True))
    assert plan.tied_head and plan.head == "lm_head"


def test_reference_inside_its_lightning_module():
    lm = LlamaLM(dict(TINY_LM))
    plan = discover(lm)
    bare = discover(lm.model)
    assert plan.embedding == "model.embed_tokens" and plan.blocks == "model.layers"
    assert plan.head == "model.lm_head" and plan.final_norm == "model.norm"
    assert plan.block_path(1) == "model.layers.1"
    # Paths inside a block do not depend on where the model sits.
    assert plan.block_plans == bare.block_plans
    assert [type(b).__name__ for b in plan.blocks_of(lm)] == ["TransformerBlock"] * 2


@pytest.mark.parametrize(
    "build",
    [reference, lambda: reference(num_experts=4), MetaTransformer],
    ids=["dense", "moe", "meta-names"],
)
def test_structural_detection_agrees_with_the_registry(build):
    model = build()
    everything = discover(model)
    structural = discover(model, sources=[PlanSource.STRUCTURAL])
    assert structural.source is PlanSource.STRUCTURAL
    assert without_provenance(structural) == without_provenance(everything)


def test_structural_reads_meta_style_names_and_head_attributes():
    plan = discover(MetaTransformer())
    assert plan.source is PlanSource.STRUCTURAL
    assert (plan.embedding, plan.blocks, plan.final_norm, plan.head) == (
        "tok_embeddings",
        "layers",
        "norm",
        "output",
    )
    att = plan.block_plans[0].attention
    assert [p.path for p in att.column] == [
        "attention.wq",
        "attention.wk",
        "attention.wv",
    ]
    assert att.o.path == "attention.wo"
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 1, 8)
    assert att.head_attributes == ("n_heads", "n_kv_heads")
    mlp = plan.block_plans[0].mlp
    assert mlp.path == "feed_forward"
    assert [p.path for p in mlp.column] == ["feed_forward.w1", "feed_forward.w3"]
    assert [p.path for p in mlp.row] == ["feed_forward.w2"]
    assert plan.block_plans[0].norms == ("attention_norm", "ffn_norm")


def test_blocks_that_differ_get_their_own_plans():
    model = reference()
    model.layers[1] = reference(num_experts=4).layers[1]
    plan = discover(model)
    assert plan.block_plans[0].mlp is not None and plan.block_plans[0].moe is None
    assert plan.block_plans[1].mlp is None and plan.block_plans[1].moe.num_experts == 4


# ---------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_llama_and_qwen2_use_their_published_plans(family, wrapped):
    model = hf_model(family)
    root = Wrapper(model) if wrapped else model
    prefix = "model." if wrapped else ""
    plan = discover(root)
    assert plan.source is PlanSource.PUBLISHED
    assert plan.embedding == f"{prefix}model.embed_tokens"
    assert plan.blocks == f"{prefix}model.layers"
    assert plan.final_norm == f"{prefix}model.norm"
    assert plan.head == f"{prefix}lm_head" and not plan.tied_head
    assert (plan.vocab_size, plan.hidden_size, plan.num_blocks) == (128, 64, 2)
    att = plan.block_plans[0].attention
    assert att.path == "self_attn"
    assert [p.path for p in att.column] == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
    ]
    assert att.o.path == "self_attn.o_proj"
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 2, 16)
    # HF attention reshapes with -1 and head_dim only: nothing for TP to rewrite.
    assert att.head_attributes == ()
    assert att.kernel is AttentionKernel.SDPA
    mlp = plan.block_plans[0].mlp
    assert [p.path for p in mlp.column] == ["mlp.gate_proj", "mlp.up_proj"]
    assert [p.path for p in mlp.row] == ["mlp.down_proj"]
    assert plan.block_plans[0].norms == ("input_layernorm", "post_attention_layernorm")
    # The published plan names no norms: the notes say which source filled them in.
    assert any("norms" in note for note in plan.notes)


def test_qwen2_biases_do_not_change_the_plan():
    model = hf_model("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert discover(model).block_plans == discover(hf_model("llama")).block_plans


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_gpt2_fused_conv1d_attention_tied_head_learned_positions(wrapped):
    model = hf_model("gpt2")
    root = Wrapper(model) if wrapped else model
    prefix = "model." if wrapped else ""
    plan = discover(root)
    # GPT-2 publishes no tensor-parallel plan.
    assert plan.source is PlanSource.REGISTRY
    assert plan.embedding == f"{prefix}transformer.wte"
    assert plan.position_embedding == f"{prefix}transformer.wpe"
    assert plan.blocks == f"{prefix}transformer.h"
    assert plan.final_norm == f"{prefix}transformer.ln_f"
    assert plan.head == f"{prefix}lm_head" and plan.tied_head
    att = plan.block_plans[0].attention
    assert att.qkv == Projection("attn.c_attn", ProjectionKind.CONV1D, (64, 64, 64))
    assert att.q is att.k is att.v is None
    assert att.o == Projection("attn.c_proj", ProjectionKind.CONV1D)
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (4, 4, 16)
    assert set(att.head_attributes) == {"num_heads", "split_size", "embed_dim"}
    mlp = plan.block_plans[0].mlp
    assert mlp.column == (Projection("mlp.c_fc", ProjectionKind.CONV1D),)
    assert mlp.row == (Projection("mlp.c_proj", ProjectionKind.CONV1D),)
    assert plan.block_plans[0].norms == ("ln_1", "ln_2")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_every_source_alone_finds_the_same_hf_plan(family):
    root = Wrapper(hf_model(family))
    expected = without_provenance(discover(root))
    for source in (PlanSource.REGISTRY, PlanSource.STRUCTURAL):
        assert without_provenance(discover(root, sources=[source])) == expected, source
    if family != "gpt2":
        # A published plan names no norms; with the tree as backup it is complete.
        published = discover(root, sources=[PlanSource.PUBLISHED, PlanSource.STRUCTURAL])
        assert published.source is PlanSource.PUBLISHED
        assert without_provenance(published) == expected


def test_hf_eager_attention_is_an_explicit_softmax():
    model = hf_model("llama", attn_implementation="eager")
    kernel = discover(model).block_plans[0].attention.kernel
    assert kernel is AttentionKernel.EXPLICIT_SOFTMAX
