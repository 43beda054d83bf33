"""An ALiBi attention routed to ring attention (issue 22), in one process: the route rebuilds the
bias from positions and matches the model's own attention; what is not proven stays refused."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.config import ContextParallelMode, SequenceSharding
from lightning_5d.parallel.context.attention import route_attention
from lightning_5d.parallel.context.batch import ContextParallelError, SequenceShard
from lightning_5d.parallel.context.ring import ring_attention
from lightning_5d.parallel.context.state import ContextState
from lightning_5d.plan import discover
from lightning_5d.plan.linear_bias import DistanceForm, LinearBias

VOCAB, DIM, HEADS, KV, N = 32, 32, 4, 2, 8


class Attention(nn.Module):
    """ALiBi in one of the written forms, the causal mask folded in (``form``), or a mask that
    stops being ALiBi at run time (``broken``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.broken, self.slope_scale = form, False, 1.0
        self.heads = HEADS
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_kv = nn.Linear(DIM, 2 * KV * DIM // HEADS, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def bias(self, n: int) -> torch.Tensor:
        slopes = torch.tensor([2 ** (-8 * (h + 1) / self.heads) for h in range(self.heads)]) * self.slope_scale
        pos = torch.arange(n)
        i, j = pos[:, None].float(), pos[None, :].float()
        distance = {"j - i": j - i, "j": j.expand(n, n), "-|i - j|": -(i - j).abs()}[self.form]
        bias = slopes[:, None, None] * distance
        if self.broken:
            bias = bias * (1 + torch.rand(n, n))
        return bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, n, KV, -1).transpose(1, 2) for t in self.to_kv(x).chunk(2, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(n), enable_gqa=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention(form)
        self.ff = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.ff(x)


class LM(nn.Module):
    def __init__(self, form: str = "j - i") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(form) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Outer(nn.Module):
    """The model inside another module, as a LightningModule holds it."""

    def __init__(self, form: str = "j - i") -> None:
        super().__init__()
        self.model = LM(form)

    def forward(self, ids):
        return self.model(ids)


class OneRank(ContextState):
    """A cp group of one rank (no process group): ring attention runs its local schedule."""

    def __init__(self, mode: ContextParallelMode = ContextParallelMode.RING) -> None:
        self.group, self.rank, self.size, self.mode, self.sharding = None, 0, 1, mode, SequenceSharding.ZIGZAG
        self.current = SequenceShard(batch=None, seq_len=N, positions=torch.arange(N), labels=None)
        self.attention_calls, self.stats, self.undo, self._global = 0, {}, [], []


@pytest.fixture(scope="module")
def plan():
    """Discovered once (the probe is the slow part): the three written forms give one plan,
    slopes x (j − i) under the causal mask (tests/unit/plan/test_linear_bias.py)."""
    torch.manual_seed(0)
    return discover(Outer())


@pytest.mark.parametrize("form", ["j - i", "j", "-|i - j|"])
def test_routed_alibi_attention_equals_the_models_own(plan, form):
    torch.manual_seed(0)
    model = Outer(form)
    ids = torch.randint(0, VOCAB, (2, N))
    expected = model(ids)
    expected.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cp = OneRank()
    description = route_attention(cp, model, plan, [])
    assert "ALiBi" in description
    got = model(ids)
    got.sum().backward()
    assert cp.attention_calls == 2 and cp.stats["forward_units"] > 0  # through ring attention
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_mask_that_is_not_the_proven_alibi_at_run_time_is_refused(plan):
    torch.manual_seed(0)
    model = Outer()
    route_attention(OneRank(), model, plan, [])
    model.model.layers[0].attn.broken = True
    with pytest.raises(ContextParallelError, match="not the ALiBi bias the discovery probe proved.*Use cp=1"):
        model(torch.randint(0, VOCAB, (1, N)))
    model.model.layers[0].attn.broken = False
    model.model.layers[0].attn.slope_scale = 2.0  # still ALiBi, but not with the slopes the probe saw
    with pytest.raises(ContextParallelError, match="not the ALiBi bias the discovery probe proved"):
        model(torch.randint(0, VOCAB, (1, N)))


def test_modes_that_regroup_heads_refuse_the_bias_with_the_modes_that_carry_it(plan):
    with pytest.raises(ContextParallelError, match="context.mode='alltoall' does not carry.*'ring' or 'allgather'"):
        route_attention(OneRank(ContextParallelMode.ALL_TO_ALL), Outer(), plan, [])


def test_a_per_head_bias_not_proven_alibi_keeps_the_refusal(plan):
    model = Outer()
    unproven = tuple(replace(b, attention=replace(b.attention, linear_bias=None)) for b in plan.block_plans)
    with pytest.raises(ContextParallelError, match="passes a per-head attention bias.*Use cp=1 for this model"):
        route_attention(OneRank(), model, replace(plan, block_plans=unproven), [])


@pytest.mark.parametrize("form", [DistanceForm.KEY_MINUS_QUERY, DistanceForm.NEGATIVE_ABSOLUTE])
@pytest.mark.parametrize("heads", [4, 1])
def test_ring_attention_with_a_bias_matches_sdpa_and_gradcheck(form, heads):
    torch.manual_seed(0)
    causal = form is DistanceForm.KEY_MINUS_QUERY
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = LinearBias((0.5, 0.25, 0.125, 0.0625)[:heads], form, causal)
    pos = torch.arange(6)
    mask = bias.scores(pos, pos).double()
    mask = mask.masked_fill(pos[None, :] > pos[:, None], float("-inf")) if causal else mask
    out = ring_attention(q, k, v, None, causal=causal, bias=bias)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    fn = lambda q, k, v: ring_attention(q, k, v, None, causal=causal, bias=bias)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_ring_attention_checks_the_bias_against_its_inputs():
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="expected 1 or 4 slopes and the same causality"):
        ring_attention(q, q, q, None, causal=True, bias=LinearBias((0.5, 0.25), DistanceForm.KEY_MINUS_QUERY, True))
    with pytest.raises(ValueError, match="expected 1 or 4 slopes and the same causality"):
        ring_attention(q, q, q, None, causal=False, bias=LinearBias((0.5,), DistanceForm.KEY_MINUS_QUERY, True))
    odd = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="even local sequence length"):
        ring_attention(odd, odd, odd, None, causal=False, bias=LinearBias((0.5,), DistanceForm.NEGATIVE_ABSOLUTE, False))
