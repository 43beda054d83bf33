"""The PyTorch-tutorial language model: ``nn.TransformerEncoder`` of
``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside: q, k and v in one
``in_proj_weight``, no ``nn.Linear`` per projection; ``batch_first``, pre-norm, ReLU) run
with a causal ``mask``; fixed sinusoidal positions in a buffer; the token embedding scaled
by sqrt(d_model) in the model's forward; the blocks are ``encoder.layers``.
"""

import math

import torch
from torch import nn

from zoo.adapter import Positional

VOCAB, D_MODEL, NHEAD, LAYERS, FFN, MAX_LEN = 256, 64, 4, 2, 128, 64


class SinusoidalPositions(nn.Module):
    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


class EncoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.d_model = D_MODEL
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        self.pos_encoder = SinusoidalPositions(D_MODEL, MAX_LEN)
        layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, FFN, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=False)
        self.decoder = nn.Linear(D_MODEL, VOCAB)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(1), device=src.device)
        x = self.pos_encoder(self.embedding(src) * math.sqrt(self.d_model))
        return self.decoder(self.encoder(x, mask=mask, is_causal=True))


def build() -> Positional:
    return Positional(EncoderLM())
