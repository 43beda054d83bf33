"""Layers in an ``nn.ModuleDict`` keyed ``"0", "1", ...`` (iterated with ``.values()``); one
fused ``qkv`` linear cut with ``chunk(3, dim=-1)`` and heads taken with
``unflatten(-1, (self.num_heads, -1))``; learned positions as a raw ``nn.Parameter``
(no ``nn.Embedding``); the feed-forward is an ``nn.Sequential(Linear, GELU, Linear)``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zoo.adapter import Positional

VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 256, 64, 4, 2, 64


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class DictLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(1, MAX_LEN, DIM) * 0.02)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.ln_f = nn.LayerNorm(DIM)
        self.unembed = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.tokens(input_ids) + self.positions[:, : input_ids.size(1)]
        for layer in self.layers.values():
            x = layer(x)
        return self.unembed(self.ln_f(x))


def build() -> Positional:
    return Positional(DictLM())
