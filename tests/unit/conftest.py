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
