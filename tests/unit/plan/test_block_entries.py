"""Blocks that are not (attention, MLP) pairs: a list alternating attention and MLP entries,
and nn.MultiheadAttention (q/k/v in one in_proj_weight) inside nn.TransformerEncoderLayer."""

import pytest
import torch
from torch import nn

from lightning_5d.plan import ProjectionKind, discover
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.parallel.tensor.validate import TensorParallelError, validate_tensor_parallel


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads  # einops-style name
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(32), fn

    def forward(self, x):
        return x + self.fn(self.norm(x))


class Alternating(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(Residual(Attention()))
            self.layers.append(Residual(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 64, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32), enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.head(self.encoder(self.emb(ids), mask=mask, is_causal=True))


def test_alternating_entries_map_attention_and_mlp_entries_each_on_their_own():
    plan = discover(Alternating())
    attentions = [b.attention is not None for b in plan.block_plans]
    mlps = [b.mlp is not None for b in plan.block_plans]
    assert attentions == [True, False, True, False] and mlps == [False, True, False, True]
    att = plan.block_plans[0].attention
    assert (att.num_heads, att.head_dim, att.head_attributes) == (4, 8, ("heads",))  # `heads` read and divided by tp
    assert [i for i, _ in plan.attentions] == [0, 2]
    validate_tensor_parallel(plan, Alternating(), 2)  # every entry is mapped for tp


def test_a_block_list_without_any_attention_is_still_refused():
    model = Alternating()
    model.layers = nn.ModuleList([model.layers[1], model.layers[3]])
    with pytest.raises(ModelMappingError, match="no attention projections found in any block"):
        discover(model)


def test_multihead_attention_is_the_attention_with_its_packed_in_projection():
    model = Encoder()
    plan = discover(model)
    att = plan.block_plans[0].attention
    assert att.path == "self_attn" and att.packed and att.qkv.kind is ProjectionKind.PACKED_IN_PROJ
    assert (att.num_heads, att.num_kv_heads, att.head_dim, att.qkv.segments) == (4, 4, 8, (32, 32, 32))
    assert att.o.path == "self_attn.out_proj"
    assert plan.block_plans[0].mlp.column[0].path == "linear1"
    validate_tensor_parallel(plan, model, 2)  # tp cuts its heads (parallel/tensor/packed_attention.py)
    model.encoder.layers[1].self_attn = nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)
    validate_tensor_parallel(discover(model), model, 2)  # bias_k / bias_v are cut by heads too
    with pytest.raises(TensorParallelError, match=r"tp=3 does not divide"):
        validate_tensor_parallel(plan, Encoder(), 3)
    # the plan's MHA runs: its output is what the whole block's check compares
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)


def test_a_model_plan_describes_an_alternating_list_with_one_pattern_per_role():
    # "layers.*.fn" names the attention in even entries and the MLP in odd ones: each entry takes what it holds.
    plan = discover(Alternating(), {
        "layers": "blocks",
        "layers.*.fn": "attention(heads=4)",
        "layers.*.fn.to_qkv": "attention.qkv",
        "layers.*.fn.to_out": "attention.o",
        "layers.*.fn.0": "mlp.column",
        "layers.*.fn.2": "mlp.row",
    })  # fmt: skip
    assert [b.attention is not None for b in plan.block_plans] == [True, False, True, False]
    assert [b.mlp is not None for b in plan.block_plans] == [False, True, False, True]
    assert plan.block_plans[2].attention.num_heads == 4
