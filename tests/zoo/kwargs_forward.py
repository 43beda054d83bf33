"""Keyword arguments all the way down: ``forward(self, *, input_ids, position_ids=None)``, each
block called as ``layer(hidden_states=h, position_ids=position_ids)`` and its attention as
``self.self_attn(hidden_states=..., cos=..., sin=...)``; biases on q, k and v; rotary tables
built once per forward from the position ids (``arange`` when none are given) and handed
down; the blocks are ``self.h``, the final norm ``self.norm_out``, the head ``self.proj_out``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zoo.adapter import Keyword

VOCAB, HIDDEN, HEADS, LAYERS, FFN = 256, 64, 4, 2, 128


def rotary_tables(position_ids: torch.Tensor, head_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq  # [b, s, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [b, 1, s, d]
    return angles.cos(), angles.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class KwAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.d_head = HEADS, HIDDEN // HEADS
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, *, hidden_states, cos, sin):
        b, s, _ = hidden_states.shape
        shape = (b, s, self.n_heads, self.d_head)
        q = self.query(hidden_states).view(shape).transpose(1, 2)
        k = self.key(hidden_states).view(shape).transpose(1, 2)
        v = self.value(hidden_states).view(shape).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, s, self.n_heads * self.d_head))


class KwMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, *, hidden_states):
        return self.down(F.silu(self.up(hidden_states)))


class KwLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = KwAttention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = KwMLP()

    def forward(self, *, hidden_states, cos, sin):
        hidden_states = hidden_states + self.self_attn(hidden_states=self.input_layernorm(hidden_states), cos=cos, sin=sin)
        return hidden_states + self.mlp(hidden_states=self.post_attention_layernorm(hidden_states))


class KwLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.h = nn.ModuleList([KwLayer() for _ in range(LAYERS)])
        self.norm_out = nn.LayerNorm(HIDDEN)
        self.proj_out = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, *, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        cos, sin = rotary_tables(position_ids, HIDDEN // HEADS)
        hidden_states = self.wte(input_ids)
        for layer in self.h:
            hidden_states = layer(hidden_states=hidden_states, cos=cos, sin=sin)
        return self.proj_out(self.norm_out(hidden_states))


def build() -> Keyword:
    return Keyword(KwLM())
