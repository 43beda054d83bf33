"""The verifier's probe settings (verify/probe_memory.py), on a world of one rank."""

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_5d.verify.probe_memory import probe_settings


def test_the_probe_prefetches_nothing_and_training_gets_its_prefetch_back(zero3_blocks):
    model, blocks = zero3_blocks
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])  # as on a GPU (fsdp._set_prefetch)
    before = list(fully_shard.state(blocks[0])._states_to_forward_prefetch)
    assert before == [fully_shard.state(blocks[1])]
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = probe_settings(units)
    assert all(fully_shard.state(u)._states_to_forward_prefetch == [] for u in units)
    with torch.no_grad():
        model(torch.arange(4).view(1, 4))
    saved.restore()
    assert fully_shard.state(blocks[0])._states_to_forward_prefetch == before
