import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (for code that needs a group or a mesh)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def zero3_blocks(world_of_one):
    """An embedding, two blocks of two linears and a head, sharded by ZeRO-3 (``apply_fsdp``) on a
    world of one CPU rank: ``(model, blocks)``."""
    from torch import nn

    from lightning_5d.config import ParallelConfig
    from lightning_5d.mesh import ParallelMesh
    from lightning_5d.parallel.data.fsdp import apply_fsdp

    model = nn.Sequential(nn.Embedding(16, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                          nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Linear(8, 16))  # fmt: skip
    blocks = [model[1], model[2]]
    apply_fsdp(model, blocks, ParallelMesh(ParallelConfig.from_mapping({}).resolve(1), "cpu"))
    return model, blocks
