"""Expert load as a torchmetrics ``Metric``: tokens per expert, imbalance, dropped tokens.

The counts it is fed are already summed over every rank that routes different tokens,
so the metric must not sum them again over the world: ``sync_on_compute=False``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class ExpertLoad(Metric):
    """Accumulates [layers, E] assignment counts and dropped assignments between resets."""

    full_state_update = False

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(sync_on_compute=False)
        self.add_state("tokens", default=torch.zeros(num_layers, num_experts, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("dropped", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, tokens_per_expert: Tensor, dropped: Tensor | int = 0) -> None:
        self.tokens += tokens_per_expert.to(self.tokens)
        self.dropped += torch.as_tensor(dropped).to(self.dropped)

    def compute(self) -> dict[str, Tensor]:
        tokens = self.tokens.double()
        per_layer_mean = tokens.mean(dim=1).clamp(min=1e-12)
        # max/mean per layer, then the worst layer: one overloaded layer sets the step's pace.
        imbalance = (tokens.max(dim=1).values / per_layer_mean).max()
        return {
            "tokens_per_expert": self.tokens.sum(0),
            "load_imbalance": imbalance.float(),
            "dropped_tokens": self.dropped.float(),
        }
