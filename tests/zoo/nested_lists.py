"""Blocks as ``nn.ModuleList``s inside an ``nn.ModuleList`` (``for attn, ff in self.layers``),
the style of many research code bases; each sub-layer holds its own pre-norm; queries from
``to_q`` and keys/values from one fused ``to_kv`` (``chunk(2, -1)``, 2 key/value heads for 4
query heads); the feed-forward is an ``nn.Sequential`` starting with its norm; no position
encoding module: ALiBi-style linear biases added to the attention scores per head.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zoo.adapter import Positional

VOCAB, DIM, HEADS, KV_HEADS, DEPTH = 256, 64, 4, 2, 2


def alibi_bias(heads: int, n: int, device) -> torch.Tensor:
    """Press et al.'s linear biases: head h penalises distance by 2^(-8(h+1)/heads), plus the causal mask."""
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device)
    pos = torch.arange(n, device=device)
    distance = (pos[None, :] - pos[:, None]).float()  # key - query, <= 0 for the past
    bias = slopes[:, None, None] * distance[None]
    return bias.masked_fill(distance[None] > 0, float("-inf"))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads, self.kv_heads, self.dim_head = HEADS, KV_HEADS, DIM // HEADS
        self.norm = nn.LayerNorm(DIM)
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_kv = nn.Linear(DIM, 2 * KV_HEADS * self.dim_head, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        x = self.norm(x)
        q = self.to_q(x).view(b, n, self.heads, self.dim_head).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, self.dim_head).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(self.heads, n, x.device))
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class NestedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            [
                nn.ModuleList(
                    [Attention(), nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))]
                )
                for _ in range(DEPTH)
            ]
        )
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        x = self.token_emb(x)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(self.norm(x))


def build() -> Positional:
    return Positional(NestedLM())
