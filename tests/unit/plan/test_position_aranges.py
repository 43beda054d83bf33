"""Position ranges a model builds with torch.arange itself (plan/position_aranges.py, found by
plan/position_reads.py): rotary angles inside each attention or once at the top, in the forms
hand-written models use, each given the shard's global positions under cp; anything the probe
cannot show to be the token's position leaves the model "not observed" (cp refuses it)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.parallel.context.positions import route_positions
from lightning_5d.plan import discover
from lightning_5d.plan.position_aranges import ArangeSiteError
from lightning_5d.plan.position_reads import PositionReadKind, _TokenLocalAttention

from cp_stand_in import fake_cp

HIDDEN, HEAD_DIM, VOCAB, MAX_LEN = 16, 4, 40, 32


def rotate(x, angles):
    """Half-split rotary on [b, h, s, d] with angles [s, d/2]."""
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    half = x.size(-1) // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def inv_freq():
    return 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


class Cache(nn.Module):
    """cos/sin tables built at init and read as their first s rows."""

    def __init__(self) -> None:
        super().__init__()
        angles = torch.outer(torch.arange(MAX_LEN, dtype=torch.float32), inv_freq())
        self.register_buffer("angles", angles, persistent=False)

    def forward(self, s):
        return self.angles[:s]


class FreqBuffer(nn.Module):
    """inv_freq as a buffer (used whole), positions from arange(s).type_as(inv_freq), einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(), persistent=False)

    def forward(self, x):
        t = torch.arange(x.shape[2], device=x.device).type_as(self.inv_freq)
        return torch.einsum("i,j->ij", t, self.inv_freq)


class Attention(nn.Module):
    """``style``: where the rotary angles come from (the forms hand-written models use)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        if style in ("cache", "gather"):
            self.cache = Cache()
        if style == "freq_buffer":
            self.rotary = FreqBuffer()

    def angles(self, s, device, past):
        style = self.style
        if style == "device_float":  # torch.arange(s, device=..., dtype=float32); frequencies from arange too
            return torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq().to(device))
        if style == "one_line":  # both aranges on one line: two sites
            return torch.outer(torch.arange(s).float(), 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
        if style == "past_offset":  # positions after a past length (0 in training)
            return torch.arange(past, past + s, dtype=torch.float32)[:, None] * inv_freq()
        if style == "cache":
            return self.cache(s)
        if style == "gather":  # cos_cached[position_ids], the ids from arange: the arange is redirected
            position_ids = torch.arange(s, device=device)
            return self.cache.angles[position_ids]
        if style == "scaled":  # not the token's position: arange(0, 2s, 2)
            return torch.arange(0, 2 * s, 2, dtype=torch.float32)[:, None] * inv_freq()
        if style == "reversed":  # counts from the end: the shard's positions would be wrong here
            return torch.arange(s, dtype=torch.float32).flip(0)[:, None] * inv_freq()
        raise AssertionError(style)

    def forward(self, x, angles=None, past: int = 0):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.style == "freq_buffer":
            angles = self.rotary(q)
        elif angles is None:
            angles = self.angles(s, x.device, past)
        q, k = rotate(q, angles), rotate(k, angles)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention(style)
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x, angles=None, past: int = 0):
        x = x + self.attn(self.norm(x), angles, past)
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class LM(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(style) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        if style == "table_to_device":
            self.freqs = torch.outer(torch.arange(MAX_LEN, dtype=torch.float32), inv_freq())  # a plain attribute

    def forward(self, ids, past: int = 0):
        x = self.embed(ids)
        angles = None
        if self.style == "top_level":  # once per forward, handed to every block
            angles = torch.outer(torch.arange(ids.size(1), device=ids.device).float(), inv_freq())
        if self.style == "table_to_device":  # Meta's llama: freqs_cis moved (a no-op here), then [start:start+n]
            self.freqs = self.freqs.to(ids.device)
            angles = self.freqs[past : past + ids.size(1)]
        for block in self.layers:
            x = block(x, angles, past)
        return self.lm_head(self.norm(x))


OBSERVED = {  # style -> (kind, the modules whose forward makes the range)
    "device_float": (PositionReadKind.ARANGE, ("layers.0.attn", "layers.1.attn")),
    "one_line": (PositionReadKind.ARANGE, ("layers.0.attn", "layers.1.attn")),
    "past_offset": (PositionReadKind.ARANGE, ("layers.0.attn", "layers.1.attn")),
    "top_level": (PositionReadKind.ARANGE, ("",)),
    "freq_buffer": (PositionReadKind.ARANGE, ("layers.0.attn.rotary", "layers.1.attn.rotary")),
    "cache": (PositionReadKind.TABLE_SLICE, ("layers.0.attn.cache", "layers.1.attn.cache")),
    "table_to_device": (PositionReadKind.TABLE_SLICE, ("",)),
    "gather": (PositionReadKind.ARANGE, ("layers.0.attn", "layers.1.attn")),
}


@pytest.mark.parametrize("style", list(OBSERVED))
def test_each_form_of_rotary_positions_is_observed_and_a_shard_rotates_by_its_global_positions(style):
    """Observed where it is made; then, attention made token-local (as the probe does), a zig-zag
    shard's rows equal the whole sequence's rows at those positions, so only ring attention is
    left to make it global."""
    torch.manual_seed(0)
    model = LM(style)
    plan = discover(model)
    kind, paths = OBSERVED[style]
    assert plan.uses_positions is True
    assert {r.kind for r in plan.position_reads} == {kind}
    assert tuple(r.path for r in plan.position_reads) == paths
    if kind is PositionReadKind.ARANGE:
        # one site each: the frequencies' arange(0, d, 2) has the same length on both probes
        assert all(len(r.sites) == 1 for r in plan.position_reads)
    ids = torch.randint(0, VOCAB, (2, 8))
    shard = torch.tensor([0, 1, 6, 7])  # zig-zag rank 0 of 8 tokens, cp=2
    with _TokenLocalAttention(), torch.no_grad():
        whole = model(ids)
        cp = fake_cp(shard, 8)
        assert "global positions" in route_positions(cp, model, plan)
        torch.testing.assert_close(model(ids[:, shard]), whole[:, shard])
        cp.current = None  # outside a step: the model's own positions
        torch.testing.assert_close(model(ids[:, :4]), whole[:, :4])
    for undo in reversed(cp.undo):
        undo()


def test_a_past_length_shifts_the_global_positions():
    torch.manual_seed(0)
    model = LM("past_offset")
    plan = discover(model)
    ids = torch.randint(0, VOCAB, (1, 4))
    cp = fake_cp(torch.tensor([0, 1, 6, 7]), 8)
    route_positions(cp, model, plan)
    with _TokenLocalAttention(), torch.no_grad():
        routed = model(ids, past=3)
        cp.current = None
        angles = torch.tensor([3.0, 4.0, 9.0, 10.0])[:, None] * inv_freq()  # 3 + the shard's positions
        x = model.embed(ids)
        for block in model.layers:
            x = x + block.attn(block.norm(x), angles)
            x = x + block.down_proj(F.gelu(block.up_proj(x)))
        torch.testing.assert_close(routed, model.lm_head(model.norm(x)))


def test_an_observed_range_of_another_length_than_the_shard_is_refused():
    torch.manual_seed(0)
    model = LM("device_float")
    route_positions(fake_cp(torch.tensor([0, 1, 6, 7]), 8), model, discover(model))
    with pytest.raises(ArangeSiteError, match="made 3 values where this rank holds 4 tokens"):
        model(torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("style", ["scaled", "reversed"])
def test_ranges_that_are_not_the_tokens_positions_leave_the_model_not_observed(style):
    """arange(0, 2s, 2) follows the length but is no position range (watch); a reversed range
    passes the watch, but the shard's positions there give other rows (token-wise proof)."""
    torch.manual_seed(0)
    plan = discover(LM(style))
    assert plan.uses_positions is None and plan.position_reads == ()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpoint_recomputation_is_redirected_too(mode):
    """The redirect wraps the attention's forward, which backward's recomputation of a
    checkpointed block calls again while the shard is current: gradients as without recompute."""
    from lightning_5d.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    model = LM("device_float")
    plan = discover(model)
    for block in model.layers:  # token-local attention entered in the forward, as cp's ring route is,
        forward = block.attn.forward  # so that the recomputation meets it too

        def local(*args, _forward=forward, **kwargs):
            with _TokenLocalAttention():
                return _forward(*args, **kwargs)

        block.attn.forward = local
    ids = torch.randint(0, VOCAB, (2, 8))
    shard = torch.tensor([0, 1, 6, 7])
    model(ids)[:, shard].square().sum().backward()  # the whole sequence's rows of the shard
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_activation_checkpointing(list(model.layers), mode)
    cp = fake_cp(shard, 8)
    route_positions(cp, model, plan)
    model(ids[:, shard]).square().sum().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want)
