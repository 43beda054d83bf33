"""Head counts as models declare them, and the attributes TP must rewrite."""

from types import SimpleNamespace

from torch import nn

from lightning_5d.plan.heads import from_configs, from_object, head_attributes


def test_spellings():
    gpt2 = from_object(SimpleNamespace(n_head=12), "config")
    assert (gpt2.num_heads, gpt2.num_kv_heads) == (12, None)
    llama = from_object(
        SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        "c",
    )
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert llama.where == "c.num_attention_heads=32, c.num_key_value_heads=8, c.head_dim=128"
    assert not from_object(SimpleNamespace(num_heads=True), "c")  # a flag, not a count


def test_nearest_config_wins():
    outer = nn.Module()
    outer.config = SimpleNamespace(num_heads=8)
    outer.inner = nn.Module()
    outer.inner.config = SimpleNamespace(num_heads=4)
    outer.inner.attn = nn.Linear(2, 2)
    assert from_configs(outer, "inner.attn").num_heads == 4
    assert from_configs(outer, "").num_heads == 8


def test_head_attributes_are_full_counts_and_widths_only():
    attn = nn.Module()
    attn.num_heads, attn.num_key_value_heads = 8, 2
    attn.head_dim, attn.num_key_value_groups = 16, 4  # per-head size and a ratio: kept
    attn.hidden_size, attn.embed_dim = 128, 100  # 128 = 8 x 16; 100 is something else
    attn.inner_dim = 32  # 2 kv heads x 16
    found = head_attributes(attn, num_heads=8, num_kv_heads=2, head_dim=16)
    assert found == ("num_heads", "num_key_value_heads", "hidden_size", "inner_dim")
