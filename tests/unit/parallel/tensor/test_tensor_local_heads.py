"""An attention module's config seen with this rank's head counts under tp (Phi-3 reads them at forward)."""

from types import SimpleNamespace

from torch import nn

from lightning_5d.parallel.tensor.sharding import _localize_config


def test_head_counts_are_local_and_everything_else_reads_through():
    shared = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, _attn_implementation="sdpa")
    attention = nn.Module()
    attention.config = shared
    _localize_config(attention, num_heads=8, num_kv_heads=4, tp=2)
    seen = attention.config
    assert (seen.num_attention_heads, seen.num_key_value_heads, seen.hidden_size) == (4, 2, 64)
    shared._attn_implementation = "ring"  # set later on the shared config (context parallelism does)
    assert seen._attn_implementation == "ring"
    seen.use_cache = False  # writes go to the shared config
    assert shared.use_cache is False and shared.num_attention_heads == 8
    _localize_config(attention, num_heads=8, num_kv_heads=4, tp=2)  # applied once only
    assert attention.config.num_attention_heads == 4


def test_a_config_with_other_head_counts_is_left_alone():
    attention = nn.Module()
    attention.config = SimpleNamespace(num_attention_heads=12)
    _localize_config(attention, num_heads=8, num_kv_heads=8, tp=2)
    assert attention.config.num_attention_heads == 12
