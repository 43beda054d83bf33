"""Plain PyTorch as one writes it from a paper: separate q/k/v/out linears, heads taken with
``view(b, s, -1, self.head_dim)`` (the module keeps the head size, never a head count),
rotary positions built inside attention from ``torch.arange(seq)`` (no position input),
``nn.RMSNorm`` and a SwiGLU feed-forward ``w2(silu(w1 x) * w3 x)``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zoo.adapter import Positional

VOCAB, DIM, HEAD_DIM, LAYERS, FFN = 256, 64, 16, 2, 128


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (Su et al.) on ``[b, s, heads, d]``, positions 0..s-1, half-split pairs."""
    s, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rotate(self.q(x).view(b, s, -1, self.head_dim))
        k = rotate(self.k(x).view(b, s, -1, self.head_dim))
        v = self.v(x).view(b, s, -1, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = SelfAttention(DIM, HEAD_DIM)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.ffn = SwiGLU(DIM, FFN)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build() -> Positional:
    return Positional(TinyTransformer())
