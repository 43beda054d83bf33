"""Roles read from a Hugging Face model's own tp/pp/ep plans."""

from plan_models import Wrapper, hf_model, reference

from lightning_5d.plan import Role
from lightning_5d.plan.published import find


def roles_of(root):
    return {pattern: spec.role for pattern, spec in find(root).roles.items()}


def test_llama_plans_become_roles():
    roles = roles_of(Wrapper(hf_model("llama")))
    assert roles["model.model.layers.*.self_attn.q_proj"] is Role.Q
    assert roles["model.model.layers.*.self_attn.k_proj"] is Role.K
    assert roles["model.model.layers.*.self_attn.v_proj"] is Role.V
    # Row-parallel beside q/k/v is the attention output; elsewhere the MLP's.
    assert roles["model.model.layers.*.self_attn.o_proj"] is Role.O
    assert roles["model.model.layers.*.mlp.gate_proj"] is Role.MLP_COLUMN
    assert roles["model.model.layers.*.mlp.down_proj"] is Role.MLP_ROW
    # The pipeline plan names the block list and the final norm.
    assert roles["model.model.layers"] is Role.BLOCKS
    assert roles["model.model.norm"] is Role.FINAL_NORM
    # Input/output embeddings come from the model's own accessors.
    assert roles["model.model.embed_tokens"] is Role.EMBEDDING
    assert roles["model.lm_head"] is Role.HEAD


def test_head_counts_come_from_the_config():
    heads = find(hf_model("qwen2")).heads
    assert (heads.num_heads, heads.num_kv_heads) == (4, 2)
    assert "config.num_attention_heads=4" in heads.where


def test_models_without_published_plans():
    assert not find(hf_model("gpt2"))  # GPT-2 publishes no tensor-parallel plan
    assert not find(reference())
