"""The verifier's probe settings (verify/probe_memory.py), on a world of one rank."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_5d.config import ParallelConfig
from lightning_5d.mesh import ParallelMesh
from lightning_5d.parallel.data.fsdp import apply_fsdp
from lightning_5d.verify.probe_memory import probe_settings


def _state(unit):
    return fully_shard.state(unit)


def blocks_model():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                          nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 16))  # fmt: skip
    return model, [model[1], model[2]]


def test_the_probe_prefetches_nothing_and_training_gets_its_prefetch_back(world_of_one):
    model, blocks = blocks_model()
    apply_fsdp(model, blocks, ParallelMesh(ParallelConfig.from_mapping({}).resolve(1), "cpu"))
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])  # as on a GPU (fsdp._set_prefetch)
    blocks[0].set_reshard_after_forward(False, recurse=False)
    before = list(_state(blocks[0])._states_to_forward_prefetch)
    assert before == [_state(blocks[1])]
    units = [m for m in model.modules() if hasattr(m, "reshard")]
    saved = probe_settings(units)
    assert all(_state(u)._states_to_forward_prefetch == [] for u in units)
    with torch.no_grad():
        model(torch.arange(4).view(1, 4))
    saved.restore()
    assert _state(blocks[0])._states_to_forward_prefetch == before
