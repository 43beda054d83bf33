"""The einops style (lucidrains-like): one fused ``to_qkv`` cut with ``.chunk(3, dim=-1)``,
heads taken with ``rearrange(t, 'b s (h d) -> b h s d', h=self.heads)`` (the head count is
an attribute the pattern reads at forward time), attention written with ``einsum`` and an
explicit causal mask, heads merged back with ``rearrange``; learned absolute positions looked
up from an optional ``position_ids`` argument (arange when absent), pre-LayerNorm, GELU MLP.
"""

import torch
from einops import rearrange
from torch import einsum, nn

from zoo.adapter import Positional

VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 256, 64, 4, 2, 128


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=self.heads) for t in (q, k, v))
        scores = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = scores.shape[-2:]
        causal = torch.ones(i, j, dtype=torch.bool, device=x.device).triu(j - i + 1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(rearrange(out, "b h s d -> b s (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim * mult)
        self.act = nn.GELU()
        self.proj_out = nn.Linear(dim * mult, dim)

    def forward(self, x):
        return self.proj_out(self.act(self.proj_in(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention(DIM, HEADS)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = FeedForward(DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class EinopsLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=tokens.device)[None]
        x = self.token_emb(tokens) + self.pos_emb(position_ids)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(self.norm(x))


def build() -> Positional:
    return Positional(EinopsLM())
