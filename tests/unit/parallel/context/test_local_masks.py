"""A causal mask a hand-written attention builds from its input's length is the shard's under cp
(a [s/cp, s/cp] triangle, not the sequence's causal structure): every form is refused, none trains.
Ring attention applies causality itself; the advice is is_causal=True."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.config import ContextParallelMode
from lightning_5d.parallel.context.attention import route_attention
from lightning_5d.parallel.context.batch import ContextParallelError, SequenceShard
from lightning_5d.parallel.context.positions import route_positions
from lightning_5d.plan import discover

HIDDEN, HEAD_DIM, VOCAB, MAX_LEN = 16, 4, 40, 32


class Attention(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        if mask in ("bias_buffer", "bias_buffer_sdpa"):  # nanoGPT's slow path
            self.register_buffer("bias", torch.ones(MAX_LEN, MAX_LEN).tril().view(1, 1, MAX_LEN, MAX_LEN))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.mask == "ones_tril":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())
        elif self.mask == "arange_compare":  # positions that reach the mask only: no read cp could redirect
            i = torch.arange(s, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])
        elif self.mask == "rotary_and_mask":  # one range for the rotary angles and the mask: redirected, mask refused
            i = torch.arange(s, device=x.device)
            angles = i[:, None].float() * torch.ones(HEAD_DIM)
            q, k = q * angles.cos() + q.flip(-1) * angles.sin(), k * angles.cos() + k.flip(-1) * angles.sin()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=i[:, None] >= i[None, :])
        elif self.mask == "bias_buffer_sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :s, :s].bool())
        else:  # bias_buffer: softmax spelled out
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
            att = att.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
            y = att.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention(mask)
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class LM(nn.Module):
    def __init__(self, mask: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(mask) for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def fake_cp():
    shard = SequenceShard(batch=None, seq_len=8, positions=torch.tensor([0, 1, 6, 7]), labels=None)
    state = SimpleNamespace(current=shard, current_shard=shard, size=2, undo=[], attention_calls=0,
                            mode=ContextParallelMode.RING)  # fmt: skip

    def wrap_forward(module, sharded):
        original = module.forward
        module.forward = lambda *a, **k: sharded(original, *a, **k)
        state.undo.append(lambda: delattr(module, "forward"))

    state.wrap_forward = wrap_forward
    return state


def route(model):
    cp = fake_cp()
    plan = discover(model)
    route_attention(cp, model, plan, [])
    route_positions(cp, model, plan)
    return cp


@pytest.mark.parametrize("mask", ["ones_tril", "rotary_and_mask"])
def test_a_causal_mask_from_the_local_length_handed_to_sdpa_is_refused_with_is_causal_as_the_advice(mask):
    torch.manual_seed(0)
    model = LM(mask)
    cp = route(model)  # no positions (ones_tril), or the range the angles and the mask share redirected
    with pytest.raises(ContextParallelError, match=r"explicit attention mask of shape \(4, 4\).*is_causal=True"):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert cp.attention_calls == 0  # refused before any attention ran on the shard


def test_a_range_that_reaches_only_the_mask_leaves_the_model_not_observed():
    """The token-wise proof passes without that arange (the stand-in ignores masks): it carries
    no token's position, so it is no read cp could redirect (ALiBi distances are the same case)."""
    torch.manual_seed(0)
    model = LM("arange_compare")
    assert discover(model).uses_positions is None
    with pytest.raises(ContextParallelError, match="each token needs its global position"):
        route(model)


def test_a_sliced_mask_buffer_is_refused_whichever_way_it_is_applied():
    torch.manual_seed(0)
    with pytest.raises(ContextParallelError, match="computes softmax|each token needs its global position"):
        route(LM("bias_buffer"))  # softmax(QKᵀ)V spelled out: no kernel to replace, and it mixes tokens
    model = LM("bias_buffer_sdpa")
    assert discover(model).uses_positions is None  # bias[:, :, :s, :s] is no read of rows [:n]
    with pytest.raises(ContextParallelError, match="each token needs its global position"):
        route(model)
