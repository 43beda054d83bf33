"""Attention projections found by watching the attention call, where names do not tell (issue 22:
the zoo's nested_lists: blocks as [attn, ff] ModuleLists, ``to_q`` and a fused ``to_kv``, ALiBi)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.plan import discover
from lightning_5d.plan.describe import describe
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.plan.model_plan import ColumnLayout

VOCAB, DIM, HEADS, KV, DEPTH = 64, 32, 4, 2, 2
D = DIM // HEADS


def alibi(heads: int, n: int, power: int = 1) -> torch.Tensor:
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    return (slopes[:, None, None] * -(-distance) ** power).masked_fill(distance > 0, float("-inf"))


class Attention(nn.Module):
    """``kv``: "halves" [k|v] (chunk(2)), "pairs" k and v interleaved per head; ``bias``: ALiBi, a
    per-head bias of squared distances, or a causal mask."""

    def __init__(self, kv: str = "halves", bias: str = "alibi") -> None:
        super().__init__()
        self.kv_layout, self.bias = kv, bias
        self.heads, self.kv_heads = HEADS, KV
        self.norm = nn.LayerNorm(DIM)
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_kv = nn.Linear(DIM, 2 * KV * D, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        x = self.norm(x)
        q = self.to_q(x).view(b, n, self.heads, D).transpose(1, 2)
        kv = self.to_kv(x)
        if self.kv_layout == "halves":
            k, v = (t.view(b, n, self.kv_heads, D).transpose(1, 2) for t in kv.chunk(2, dim=-1))
        else:
            k, v = kv.view(b, n, self.kv_heads, 2, D).transpose(1, 2).unbind(-2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        if self.bias in ("alibi", "squared"):
            mask = alibi(self.heads, n, power=1 if self.bias == "alibi" else 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class NestedLM(nn.Module):
    def __init__(self, **attention) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        ff = lambda: nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))  # noqa: E731
        self.layers = nn.ModuleList([nn.ModuleList([Attention(**attention), ff()]) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(self.norm(x))


class Outer(nn.Module):
    """The model inside another module (as a LightningModule holds it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)


def test_separate_q_and_fused_kv_observed_from_the_attention_call():
    torch.manual_seed(0)
    plan = discover(Outer(NestedLM()))
    assert plan.blocks == "model.layers" and plan.num_blocks == DEPTH
    for block in plan.block_plans:
        att = block.attention
        assert att.path == "0"
        assert att.q.path == "0.to_q" and att.q.layout is ColumnLayout.PLAIN
        assert att.kv.path == "0.to_kv" and att.kv.segments == (KV * D, KV * D)
        assert att.kv.layout is ColumnLayout.SEGMENTS
        assert (att.k, att.v, att.qkv) == (None, None, None)
        assert att.o.path == "0.to_out"
        assert (att.num_heads, att.num_kv_heads, att.head_dim) == (HEADS, KV, D)
        assert set(att.head_attributes) == {"heads", "kv_heads"}
        assert att.per_head_bias
        # The pre-norm feeds to_q: a norm of the hidden state, not one over the q width.
        assert "0.norm" in block.norms
        assert [p.path for p in block.mlp.column] == ["1.1"] and [p.path for p in block.mlp.row] == ["1.3"]
    assert any("observed from the probe's attention call" in n for n in plan.notes)


def test_a_causal_mask_is_no_per_head_bias():
    torch.manual_seed(0)
    plan = discover(Outer(NestedLM(bias="causal")))
    assert not plan.block_plans[0].attention.per_head_bias
    assert plan.block_plans[0].attention.linear_bias is None


def test_alibi_is_proven_and_its_positions_need_nothing_from_the_model():
    """The probe reads the mask as slopes x (j − i) under the causal mask; its arange feeds that
    mask only, so the model reads no position context parallelism must redirect (NoPE)."""
    torch.manual_seed(0)
    plan = discover(Outer(NestedLM()))
    bias = plan.block_plans[0].attention.linear_bias
    assert bias is not None and bias.causal and bias.form.value == "key_minus_query"
    assert bias.slopes == tuple(2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS))
    assert plan.uses_positions is False and plan.position_reads == ()
    assert "bias              ALiBi key_minus_query, causal; slopes 0.25, 0.0625" in describe(plan)


def test_a_per_head_bias_that_is_not_linear_in_the_distance_is_not_proven():
    """Squared distances per head: a per-head bias (tp rebuilds it per rank), not ALiBi (cp stays
    refused), and its arange reaches the output through a mask ring attention would not rebuild."""
    torch.manual_seed(0)
    plan = discover(Outer(NestedLM(bias="squared")))
    att = plan.block_plans[0].attention
    assert att.per_head_bias and att.linear_bias is None
    assert plan.uses_positions is None  # not observed
    assert "bias              per-head (not slopes x distances)" in describe(plan)


def test_parameters_untouched_by_the_probe():
    torch.manual_seed(0)
    model = Outer(NestedLM())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    discover(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(m.training for m in model.modules())


def test_k_and_v_interleaved_in_one_linear_are_refused_naming_the_module_holding_the_blocks():
    # No [k|v] cut keeps k and v apart: the observation gives no plan, and the error names
    # NestedLM (which holds model.layers), not the wrapper around it.
    torch.manual_seed(0)
    with pytest.raises(ModelMappingError) as caught:
        discover(Outer(NestedLM(kv="pairs")))
    message = str(caught.value)
    assert message.startswith("Cannot map NestedLM (model, holding model.layers) for parallelism")
    assert "Outer" not in message.splitlines()[0]


def test_explicit_kv_role():
    torch.manual_seed(0)
    plan = discover(
        Outer(NestedLM()),
        {
            "model.layers.*.0": "attention(heads=4, kv_heads=2)",
            "model.layers.*.0.to_q": "attention.q",
            "model.layers.*.0.to_kv": "attention.kv",
            "model.layers.*.0.to_out": "attention.o",
        },
    )
    att = plan.block_plans[1].attention
    assert att.kv.path == "0.to_kv" and att.kv.segments == (KV * D, KV * D)
    assert plan.source.value == "explicit"
