import lightning as L
import pytest
import torch

from lightning_5d.auto_layout import AUTO_DIMS, planned_config
from lightning_5d.config import ParallelConfig
from lightning_5d.models import LlamaConfig, LlamaLM


def plan_for(module, world_size=4):
    return planned_config(
        ParallelConfig(), module, world_size, precision="32-true", device=torch.device("cpu"), local_processes=world_size
    )


def test_planner_picks_a_valid_layout_of_the_available_dims():
    cfg = plan_for(LlamaLM(LlamaConfig(num_layers=2)))
    layout = cfg.resolve(4)
    assert layout.world_size == 4
    for dim in ("cp", "tp", "pp", "ep"):
        assert dim in AUTO_DIMS or getattr(layout, dim) == 1
    assert layout.cp == 1  # never without the user: cp needs the data contract (aligned labels, seq % 2cp)


class Opaque(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))


def test_model_the_planner_cannot_read_falls_back_to_zero1_with_a_warning():
    with pytest.warns(UserWarning, match="planner could not choose a layout"):
        cfg = plan_for(Opaque())
    assert cfg == ParallelConfig()
