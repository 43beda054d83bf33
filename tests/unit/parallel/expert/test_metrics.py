"""Single-process checks of the ExpertLoad metric: accumulation, imbalance, reset."""

import pytest
import torch

from lightning_5d.parallel.expert.metrics import ExpertLoad


def test_expert_load_accumulates_and_computes():
    metric = ExpertLoad(num_layers=2, num_experts=4)
    first = torch.tensor([[3, 1, 0, 4], [2, 2, 2, 2]])
    second = torch.tensor([[1, 1, 4, 0], [6, 0, 1, 1]])
    metric.update(first, 3)
    metric.update(second, torch.tensor(2))
    out = metric.compute()

    summed = [[4, 2, 4, 4], [8, 2, 3, 3]]
    assert out["tokens_per_expert"].tolist() == [12, 4, 7, 7]
    per_layer = [max(row) / (sum(row) / len(row)) for row in summed]  # 4/3.5, 8/4
    assert out["load_imbalance"].item() == pytest.approx(max(per_layer), rel=1e-6)
    assert out["load_imbalance"].item() == pytest.approx(2.0, rel=1e-6)
    assert out["dropped_tokens"].item() == 5.0


def test_expert_load_default_dropped_is_zero_and_balanced_load_is_one():
    metric = ExpertLoad(num_layers=1, num_experts=3)
    metric.update(torch.tensor([[5, 5, 5]]))
    out = metric.compute()
    assert out["tokens_per_expert"].tolist() == [5, 5, 5]
    assert out["load_imbalance"].item() == pytest.approx(1.0)
    assert out["dropped_tokens"].item() == 0.0


def test_expert_load_reset_zeroes_the_state():
    metric = ExpertLoad(num_layers=2, num_experts=4)
    metric.update(torch.tensor([[3, 1, 0, 4], [2, 2, 2, 2]]), 7)
    metric.compute()
    metric.reset()
    assert torch.equal(metric.tokens, torch.zeros(2, 4, dtype=torch.long))
    assert metric.dropped.item() == 0
    metric.update(torch.tensor([[1, 0, 0, 0], [0, 0, 0, 1]]), 1)
    out = metric.compute()
    assert out["tokens_per_expert"].tolist() == [1, 0, 0, 1]
    assert out["dropped_tokens"].item() == 1.0
    assert out["load_imbalance"].item() == pytest.approx(4.0)
