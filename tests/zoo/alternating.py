"""One flat block list alternating attention and feed-forward entries (``layers[0]`` attention,
``layers[1]`` MLP, ``layers[2]`` attention, ...), each wrapped as ``Residual(PreNorm(fn))``;
attention computed explicitly (``q @ k^T * scale``, a causal mask, softmax) from a fused
``to_qkv`` cut with ``chunk(3, -1)``; the final norm and the head live together in
``to_logits = nn.Sequential(LayerNorm, Linear)``; learned positions in an ``nn.Embedding``.
"""

import torch
from torch import nn

from zoo.adapter import Positional

VOCAB, DIM, HEADS, DEPTH, MAX_LEN = 256, 64, 4, 2, 64


class Residual(nn.Module):
    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return x + self.fn(x)


class PreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = (q @ k.transpose(-1, -2)) * self.scale
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = dots.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.to_out((attn @ v).permute(0, 2, 1, 3).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class AlternatingLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList()
        for _ in range(DEPTH):
            self.layers.append(Residual(PreNorm(DIM, Attention(DIM, HEADS))))
            self.layers.append(Residual(PreNorm(DIM, FeedForward(DIM))))
        self.to_logits = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))

    def forward(self, x):
        h = self.token_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            h = layer(h)
        return self.to_logits(h)


def build() -> Positional:
    return Positional(AlternatingLM())
