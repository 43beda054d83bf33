"""Where context parallelism finds a model's positions (backbone position_ids or a RoPE cache)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.parallel.context.batch import ContextParallelError, SequenceShard
from lightning_5d.parallel.context.positions import _rows_at, find_backbone, route_positions
from lightning_5d.plan import discover

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def fake_cp(positions, seq_len):
    shard = SequenceShard(batch=None, seq_len=seq_len, positions=positions, labels=None)
    return SimpleNamespace(current=shard, size=2, undo=[])


def test_backbone_is_the_deepest_module_holding_the_blocks_that_takes_position_ids():
    module = LlamaLM(TINY)
    path, backbone = find_backbone(module, discover(module))
    assert path == "model" and backbone is module.model


def test_backbone_gets_global_positions_when_the_caller_passes_none():
    torch.manual_seed(0)
    module = LlamaLM(TINY)
    ids = torch.randint(0, 64, (2, 8))
    positions = torch.tensor([0, 1, 6, 7])  # zig-zag rank 0 of 8 tokens on cp=2
    cp = fake_cp(positions, 8)
    route_positions(cp, module, discover(module))
    routed = module(ids[:, positions])
    expected = module(ids[:, positions], positions.unsqueeze(0))  # caller-given positions are kept
    torch.testing.assert_close(routed, expected)
    with pytest.raises(ContextParallelError, match="not this rank's global positions"):
        module(ids[:, positions], torch.arange(4))  # built from the local length: refused
    cp.current = None  # outside a step: untouched
    torch.testing.assert_close(module(ids[:, :4]), module(ids[:, :4], torch.arange(4)))
    for undo in cp.undo:
        undo()
    assert not module.model._forward_pre_hooks


def test_a_call_on_another_length_than_the_shard_is_refused():
    module = LlamaLM(TINY)
    route_positions(fake_cp(torch.arange(4), 8), module, discover(module))
    with pytest.raises(ContextParallelError, match="called on 6 tokens, but this rank's shard .* holds 4"):
        module(torch.zeros(1, 6, dtype=torch.long))


def test_rope_cache_rows_are_picked_at_the_global_positions():
    cos = torch.arange(8.0).view(8, 1).expand(8, 4)
    picked = _rows_at((cos, cos[None, None]), torch.tensor([0, 1, 6, 7]), 8)
    assert picked[0][:, 0].tolist() == [0, 1, 6, 7]
    assert picked[1].shape == (1, 1, 4, 4) and picked[1][0, 0, :, 0].tolist() == [0, 1, 6, 7]


def test_model_without_reachable_positions_is_refused_with_what_to_add():
    module = LlamaLM(TINY)
    plan = discover(module)
    # Neither the backbone nor the LightningModule takes position_ids, and no rotary module exists.
    module.model.forward = lambda input_ids: None
    module.forward = lambda input_ids: None
    with pytest.raises(ContextParallelError, match=r"LlamaModel.forward .* takes no position_ids"):
        route_positions(fake_cp(torch.arange(4), 8), module, plan)


def test_a_model_observed_to_use_no_positions_needs_no_route():
    module = LlamaLM(TINY)
    plan = dataclasses.replace(discover(module), uses_positions=False)  # as the probe finds a NoPE model
    module.model.forward = lambda input_ids: None
    module.forward = lambda input_ids: None
    assert "none needed" in route_positions(fake_cp(torch.arange(4), 8), module, plan)
    # Not observed (None) keeps the refusal: a position source may exist that discovery cannot see.
    with pytest.raises(ContextParallelError):
        route_positions(fake_cp(torch.arange(4), 8), module, dataclasses.replace(plan, uses_positions=None))
