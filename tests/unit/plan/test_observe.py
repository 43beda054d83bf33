"""The probe forward decides how fused projections order their output features (issue 22)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.plan import discover
from lightning_5d.plan.model_plan import ColumnLayout

HIDDEN, HEADS, INTER = 16, 4, 24
D = HIDDEN // HEADS


class FusedAttention(nn.Module):
    """``qkv`` laid out as ``order`` says: "concat" [q|k|v], "per_head" GPT-NeoX, "one_head" (no split)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order, self.num_heads = order, HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)
        if self.order == "per_head":
            q, k, v = y.view(b, s, HEADS, 3 * D).transpose(1, 2).chunk(3, dim=-1)
        elif self.order == "concat":
            q, k, v = (t.view(b, s, HEADS, D).transpose(1, 2) for t in y.chunk(3, dim=-1))
        else:  # one head of full width, whatever the declared head count says
            q, k, v = (t.unsqueeze(1) for t in y.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class FusedMLP(nn.Module):
    """``gate_up_proj`` as [gate | up] ("halves"), or pairs [g_0, u_0, g_1, u_1, ...]."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER)
        self.down_proj = nn.Linear(INTER, HIDDEN)

    def forward(self, x):
        y = self.gate_up_proj(x)
        gate, up = y.chunk(2, dim=-1) if self.order == "halves" else (y[..., 0::2], y[..., 1::2])
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attention: str, mlp: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = FusedAttention(attention), FusedMLP(mlp)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, attention: str = "concat", mlp: str = "halves", takes_ids: bool = True) -> None:
        super().__init__()
        self.takes_ids = takes_ids
        self.embed = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList(Block(attention, mlp) for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, 50)

    def forward(self, batch):
        x = self.embed(batch if self.takes_ids else batch["input_ids"])
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


@pytest.mark.parametrize(
    "order, layout, segments",
    [
        ("concat", ColumnLayout.SEGMENTS, (HIDDEN,) * 3),
        ("per_head", ColumnLayout.PER_GROUP, ()),
        ("one_head", ColumnLayout.UNKNOWN, ()),
    ],
)
def test_fused_qkv_layout_is_observed(order, layout, segments):
    plan = discover(Net(attention=order))
    for block in plan.block_plans:
        assert block.attention.qkv.layout is layout
        assert block.attention.qkv.segments == segments


@pytest.mark.parametrize(
    "order, layout, segments",
    [("halves", ColumnLayout.SEGMENTS, (INTER, INTER)), ("pairs", ColumnLayout.PER_GROUP, ())],
)
def test_fused_gate_up_layout_is_observed(order, layout, segments):
    plan = discover(Net(mlp=order))
    (column,) = plan.block_plans[0].mlp.column
    assert (column.path, column.layout, column.segments) == ("mlp.gate_up_proj", layout, segments)


def test_an_explicit_plan_gets_the_observed_layout_too():
    explicit = {"layers.*.mlp.gate_up_proj": "mlp.column", "layers.*.mlp.down_proj": "mlp.row"}
    (column,) = discover(Net(mlp="halves"), explicit).block_plans[0].mlp.column
    assert column.segments == (INTER, INTER)


def test_a_model_the_probe_cannot_run_keeps_the_shape_default_and_says_so():
    plan = discover(Net(attention="per_head", takes_ids=False))
    assert plan.block_plans[0].attention.qkv.layout is ColumnLayout.SEGMENTS  # not observed: the old default
    assert plan.block_plans[0].mlp.column[0].segments == (INTER, INTER)
    assert any("not observed" in n for n in plan.notes)


def test_the_probe_leaves_parameters_gradients_and_modes_alone():
    net = Net(attention="per_head").train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    discover(net)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p.grad is None for p in net.parameters())
    assert all(m.training for m in net.modules())


def test_tensor_parallelism_refuses_an_unknown_layout_naming_the_projection():
    from lightning_5d.parallel.tensor.validate import TensorParallelError, validate_tensor_parallel

    net = Net(attention="one_head")
    with pytest.raises(TensorParallelError, match=r"layers\.0\.attn\.qkv.*tp=1"):
        validate_tensor_parallel(discover(net), net, 2)
