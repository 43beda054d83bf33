"""Attention cp cannot route is refused at setup, with a way out that works."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_5d.parallel.context.attention import route_attention
from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.plan import discover


class EncoderLM(nn.Module):
    """nn.TransformerEncoder with a causal mask (the PyTorch tutorial's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        self.decoder = nn.Linear(16, 40)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.decoder(self.encoder(self.embedding(ids), mask=mask, is_causal=True))


def test_multihead_attention_is_refused_because_its_sdpa_call_cannot_be_reached():
    torch.manual_seed(0)
    model = EncoderLM()
    cp = SimpleNamespace(size=2, undo=[])
    with pytest.raises(ContextParallelError, match="nn.MultiheadAttention.*Use cp=1"):
        route_attention(cp, model, discover(model), [])
