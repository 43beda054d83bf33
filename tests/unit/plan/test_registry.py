"""Known architectures by class name (and defining library)."""

from plan_models import Wrapper, hf_model, reference

from lightning_5d.plan import Role
from lightning_5d.plan.registry import KNOWN_ARCHITECTURES, find


def test_reference_llama_is_known_wherever_it_sits():
    role_map = find(Wrapper(reference()))
    assert role_map.roles["model.layers.*.attention.q_proj"].role is Role.Q
    assert role_map.roles["model.layers.*.moe.router"].role is Role.ROUTER
    assert (role_map.heads.num_heads, role_map.heads.num_kv_heads) == (4, 2)
    assert role_map.notes == ("known architecture LlamaModel at model",)


def test_same_class_name_in_two_libraries():
    ours = [k for k in KNOWN_ARCHITECTURES if k.class_name == "LlamaModel"]
    assert len(ours) == 2
    hf_base = hf_model("llama").model
    assert [k.module_prefix for k in ours if k.matches(hf_base)] == ["transformers."]
    assert [k.module_prefix for k in ours if k.matches(reference())] == ["lightning_5d."]


def test_gpt2_entry():
    roles = find(hf_model("gpt2")).roles
    assert roles["transformer.h.*.attn.c_attn"].role is Role.QKV
    assert roles["transformer.h.*.attn.c_proj"].role is Role.O
    assert roles["transformer.h.*.mlp.c_proj"].role is Role.MLP_ROW
    assert roles["transformer.wpe"].role is Role.POSITION_EMBEDDING


def test_unknown_models_get_nothing():
    from torch import nn

    assert not find(nn.Sequential(nn.Linear(2, 2)))
