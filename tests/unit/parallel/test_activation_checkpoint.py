"""The three modes recompute different work in backward and give the same gradients."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_5d.config import ActivationCheckpointing
from lightning_5d.models import LlamaConfig, LlamaModel
from lightning_5d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_5d.plan.blocks import ModelMappingError, find_blocks, require_blocks

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops_and_grads(model, ids):
    loss = model(ids).float().logsumexp(-1).mean()
    with OpCounter() as counter:
        loss.backward()
    return counter.calls, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_modes_recompute_what_they_promise_and_preserve_gradients():
    torch.manual_seed(0)
    base = LlamaModel(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 64))
    results = {}
    for mode in ActivationCheckpointing:
        model = copy.deepcopy(base)
        apply_activation_checkpointing(find_blocks(model)[1], mode)
        results[mode] = backward_ops_and_grads(model, ids)
    none, selective, full = (results[m][0] for m in ActivationCheckpointing)
    # Forward matmuls run again only under full recompute; selective replays the cheap
    # element-wise ops (here: RMSNorm's rsqrt, SwiGLU's silu) but keeps matmul outputs.
    assert none.get("mm", 0) == selective.get("mm", 0) < full.get("mm", 0)
    for op in ("rsqrt", "silu"):
        assert none.get(op, 0) < selective.get(op, 0) and none.get(op, 0) < full.get(op, 0), op
    for mode in (ActivationCheckpointing.SELECTIVE, ActivationCheckpointing.FULL):
        for name, grad in results[ActivationCheckpointing.NONE][1].items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=1e-5, atol=1e-7)


def test_state_dict_keys_unchanged():
    model = LlamaModel(CFG)
    keys = set(model.state_dict())
    apply_activation_checkpointing(find_blocks(model)[1], ActivationCheckpointing.FULL)
    assert set(model.state_dict()) == keys


def test_block_discovery_finds_the_layer_list():
    path, blocks = find_blocks(LlamaModel(CFG))
    assert path == "layers" and len(blocks) == 3


def test_model_without_blocks_gets_an_actionable_error():
    with pytest.raises(ModelMappingError, match="nn.ModuleList"):
        require_blocks(torch.nn.Linear(4, 4), "activation_checkpointing=full")
