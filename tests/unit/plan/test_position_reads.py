"""Where a model without a position input reads its positions (plan/position_reads.py), and
what context parallelism does with it (parallel/context/positions.py): each kind of read is
found and redirected; anything the probe cannot follow leaves the model "not observed"."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.parallel.context.positions import route_positions
from lightning_5d.plan import discover
from lightning_5d.plan.position_reads import PositionRead, PositionReadError, PositionReadKind

from cp_stand_in import fake_cp

HIDDEN, HEAD_DIM, VOCAB, MAX_LEN = 16, 4, 40, 32


class Attention(nn.Module):
    def __init__(self, explicit: bool = False, rotary: bool = False) -> None:
        super().__init__()
        self.explicit, self.rotary = explicit, rotary
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.rotary:  # angles from arange inside attention (tests/unit/plan/test_position_aranges.py)
            angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.ones(HEAD_DIM // 2)
            cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
            q = q * cos + torch.cat([-q[..., 2:], q[..., :2]], -1) * sin
            k = k * cos + torch.cat([-k[..., 2:], k[..., :2]], -1) * sin
        if self.explicit:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, **attention) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention(**attention)
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class LM(nn.Module):
    """``positions``: how the forward adds positions (the styles of the zoo, and ones not followed)."""

    def __init__(self, positions: str = "none", **attention) -> None:
        super().__init__()
        self.positions = positions
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        if positions == "arange_embedding":
            self.wpe = nn.Embedding(MAX_LEN, HIDDEN)
        if positions == "parameter":
            self.table = nn.Parameter(torch.randn(1, MAX_LEN, HIDDEN))
        if positions in ("buffer", "checked_buffer"):
            self.register_buffer("pe", torch.randn(MAX_LEN, HIDDEN))
        self.layers = nn.ModuleList(Block(**attention) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        n = ids.size(1)
        if self.positions == "arange_embedding":
            x = x + self.wpe(torch.arange(0, n, device=ids.device)[None])
        elif self.positions == "parameter":
            x = x + self.table[:, :n]
        elif self.positions == "buffer":
            x = x + self.pe[:n]
        elif self.positions == "checked_buffer":  # a length check reads the table's size, not its rows
            assert n <= self.pe.size(0) and self.pe.dim() == 2
            x = x + self.pe[:n]
        elif self.positions == "linspace":  # positions without arange or a held tensor
            x = x + torch.linspace(0, 1, n)[:, None].sin()
        elif self.positions == "length_scaled":  # depends on the shard's length
            x = x * n**-0.5
        elif self.positions == "offset_slice":  # a table read at rows other than [:n]
            x = x + self.embed.weight[1 : n + 1]
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize(
    "positions, expected",
    [
        ("none", ()),
        ("arange_embedding", (PositionRead(PositionReadKind.ARANGE_EMBEDDING, "wpe"),)),
        ("parameter", (PositionRead(PositionReadKind.TABLE_SLICE, "", "table", 1),)),
        ("buffer", (PositionRead(PositionReadKind.TABLE_SLICE, "", "pe", 0),)),
        ("checked_buffer", (PositionRead(PositionReadKind.TABLE_SLICE, "", "pe", 0),)),
    ],
)
def test_each_kind_of_read_is_found(positions, expected):
    torch.manual_seed(0)
    plan = discover(LM(positions))
    assert plan.position_reads == expected
    assert plan.uses_positions is bool(expected)


@pytest.mark.parametrize("positions", ["linspace", "length_scaled", "offset_slice"])
def test_positions_the_probe_cannot_follow_leave_the_model_not_observed(positions):
    torch.manual_seed(0)
    plan = discover(LM(positions))
    assert plan.uses_positions is None and plan.position_reads == ()


def test_explicit_softmax_attention_is_not_observed():
    """The token-local stand-in replaces SDPA only: softmax(QKᵀ)V spelled out mixes tokens."""
    torch.manual_seed(0)
    assert discover(LM("none", explicit=True)).uses_positions is None
    assert discover(LM("arange_embedding", explicit=True)).uses_positions is None


def test_rotary_from_arange_in_attention_is_observed_next_to_a_position_embedding():
    torch.manual_seed(0)
    plan = discover(LM("arange_embedding", rotary=True))
    kinds = [(r.kind, r.path) for r in plan.position_reads]
    assert kinds == [(PositionReadKind.ARANGE, "layers.0.attn"), (PositionReadKind.ARANGE, "layers.1.attn"),
                     (PositionReadKind.ARANGE_EMBEDDING, "wpe")]  # fmt: skip


@pytest.mark.parametrize("positions", ["arange_embedding", "parameter", "buffer"])
def test_a_shard_reads_the_rows_of_its_global_positions(positions):
    """Under cp a shard's tokens get what they get in the whole sequence at those positions."""
    torch.manual_seed(0)
    model = LM(positions)
    plan = discover(model)
    ids = torch.randint(0, VOCAB, (1, 8))
    shard = torch.tensor([0, 1, 6, 7])  # zig-zag rank 0 of 8 tokens, cp=2
    seen = {}
    block = model.layers[0]
    block.register_forward_pre_hook(lambda m, a: seen.__setitem__("hidden", a[0]))
    model(ids)
    whole = seen["hidden"]
    cp = fake_cp(shard, 8)
    assert "global positions" in route_positions(cp, model, plan)
    model(ids[:, shard])
    torch.testing.assert_close(seen["hidden"], whole[:, shard])  # the blocks' input: token + its position
    cp.current = None  # outside a step: the model's own positions
    model(ids[:, :4])
    torch.testing.assert_close(seen["hidden"], whole[:, :4])
    for undo in cp.undo:
        undo()


def test_an_embedding_read_that_gets_no_arange_is_refused_not_redirected():
    torch.manual_seed(0)
    model = LM("arange_embedding")
    cp = fake_cp(torch.tensor([0, 1, 6, 7]), 8)
    route_positions(cp, model, discover(model))
    with pytest.raises(PositionReadError, match="not arange"):
        model.wpe(torch.tensor([[3, 2, 1, 0]]))


class NoForward(nn.Module):
    """Parameters on the root, which has no forward (a LightningModule that is the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def logits(self, ids, extra=None):
        x = self.embed(ids)
        if extra is not None:
            x = x + extra
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def test_a_root_without_forward_is_run_as_a_chain_and_each_step_must_follow_it():
    torch.manual_seed(0)
    model = NoForward()
    plan = discover(model)
    assert plan.chain_assumed and plan.uses_positions is False
    cp = fake_cp(torch.tensor([0, 1, 6, 7]), 8)
    assert "none needed" in route_positions(cp, model, plan)
    ids = torch.randint(0, VOCAB, (1, 4))
    model.logits(ids)  # the chain: accepted
    with pytest.raises(ContextParallelError, match="layers.0 was not called on embed's output"):
        model.logits(ids, extra=1.0)  # code between the embedding and the blocks the probe never saw
