"""Zoo models changed exactly as a context-parallel refusal advises (issue 22): each variant
keeps its original's modules and weights (built the same way, from the same seed) and
only swaps the class of the modules the advice names for a subclass whose forward does
what the message asks. The originals stay as their authors wrote them.

* ``alternating_sdpa``: ``alternating``'s refusal ("computes softmax(QKᵀ)V itself ... call
  F.scaled_dot_product_attention in its forward"): its attention calls SDPA.
* ``einops_sdpa``: the same advice for ``einops_style``.
* ``plain_torch_positions``: ``plain_torch``'s refusal ("Add a position_ids argument to
  TinyTransformer.forward and build the position embedding (RoPE cos/sin ...) from it,
  defaulting to arange(seq_len) when it is None"): the rotary angles come from
  ``position_ids``, handed down to each block's attention.
"""

import torch
import torch.nn.functional as F

from zoo import alternating, plain_torch


class SdpaAttention(alternating.Attention):
    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def alternating_sdpa():
    module = alternating.build()
    for entry in module.model.layers:
        if isinstance(entry.fn.fn, alternating.Attention):
            entry.fn.fn.__class__ = SdpaAttention
    return module


def einops_sdpa():
    from einops import rearrange

    from zoo import einops_style

    class EinopsSdpaAttention(einops_style.Attention):
        def forward(self, x):
            q, k, v = self.to_qkv(x).chunk(3, dim=-1)
            q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=self.heads) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return self.to_out(rearrange(out, "b h s d -> b s (h d)"))

    module = einops_style.build()
    for layer in module.model.layers:
        layer.attn.__class__ = EinopsSdpaAttention
    return module


def rotate_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """``plain_torch.rotate`` with the angles of ``positions`` ([s] or [1, s]) instead of 0..s-1."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(positions.reshape(-1).to(torch.float32), inv_freq)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PositionedAttention(plain_torch.SelfAttention):
    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q = rotate_at(self.q(x).view(b, s, -1, self.head_dim), position_ids)
        k = rotate_at(self.k(x).view(b, s, -1, self.head_dim), position_ids)
        v = self.v(x).view(b, s, -1, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class PositionedBlock(plain_torch.Block):
    def forward(self, x, position_ids):
        x = x + self.attn(self.attn_norm(x), position_ids)
        return x + self.ffn(self.ffn_norm(x))


class PositionedTransformer(plain_torch.TinyTransformer):
    def forward(self, tokens, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(tokens.size(1), device=tokens.device)[None]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.norm(x))


def plain_torch_positions():
    module = plain_torch.build()
    module.model.__class__ = PositionedTransformer
    for block in module.model.blocks:
        block.__class__ = PositionedBlock
        block.attn.__class__ = PositionedAttention
    return module
