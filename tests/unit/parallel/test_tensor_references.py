"""TensorParallel keeps no reference to the tensors it cut once the cut is done."""

import gc
import weakref

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from lightning_5d.models.llama import LlamaConfig, LlamaModel
from lightning_5d.parallel.tensor import TensorParallel
from lightning_5d.plan import discover

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def _replace_parameters(model: torch.nn.Module) -> None:
    """What ZeRO-3 (FSDP2) does to every parameter after tp: registers a new one in its place."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach().clone()))


def test_replaced_tp_parameters_are_freed(world_of_one):
    model = LlamaModel(TINY)
    tp = TensorParallel(model, discover(model), init_device_mesh("cpu", (1,)), sequence_parallel=False)
    assert tp.shards  # the projections, embedding and head were cut
    local = {n: weakref.ref(p) for n, p in model.named_parameters()}
    _replace_parameters(model)
    gc.collect()
    alive = [n for n, ref in local.items() if ref() is not None]
    assert alive == [], f"tp-local tensors still referenced after being replaced: {alive[:4]}"
    assert tp.is_sharded("layers.0.attention.q_proj.weight")  # what checkpoints and clipping need stays
