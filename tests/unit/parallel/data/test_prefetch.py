"""ZeRO-3's prefetch (parallel/data/fsdp.py), on a world of one rank."""

from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_5d.config import ParallelConfig
from lightning_5d.mesh import ParallelMesh
from lightning_5d.parallel.data.fsdp import apply_fsdp


def _state(unit):
    return fully_shard.state(unit)


def blocks_model():
    model = nn.Sequential(nn.Embedding(16, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                          nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 16))  # fmt: skip
    return model, [model[1], model[2]]


def test_cpu_units_are_not_prefetched(world_of_one):
    """gloo blocks the caller: a prefetched gather on CPU overlaps nothing and holds one more block."""
    model, blocks = blocks_model()
    apply_fsdp(model, blocks, ParallelMesh(ParallelConfig.from_mapping({}).resolve(1), "cpu"))
    assert all(_state(b)._states_to_forward_prefetch == [] for b in blocks)
    assert all(_state(b)._states_to_backward_prefetch is None or _state(b)._states_to_backward_prefetch == []
               for b in blocks)  # fmt: skip
