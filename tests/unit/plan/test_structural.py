"""Finding the parts from the module tree alone, and what it cannot map."""

import pytest
from torch import nn

from lightning_5d.parallel.tensor.validate import validate_tensor_parallel
from lightning_5d.plan import ModelMappingError, PlanSource, discover


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)


class SparseBlock(nn.Module):
    """Mixtral-like names: the router is called `gate`, next to an expert list."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.num_heads = heads
        self.attn.query, self.attn.key, self.attn.value = (nn.Linear(dim, dim) for _ in range(3))
        self.attn.out_proj = nn.Linear(dim, dim)
        self.sparse = nn.Module()
        self.sparse.gate = nn.Linear(dim, 3, bias=False)
        self.sparse.experts = nn.ModuleList(Expert(dim) for _ in range(3))


class SparseNet(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, dim)
        self.blocks = nn.ModuleList(SparseBlock(dim) for _ in range(2))
        self.ln_f = nn.LayerNorm(dim)


def test_router_beside_experts_is_a_moe_and_headless_is_fine():
    plan = discover(SparseNet())
    assert plan.source is PlanSource.STRUCTURAL
    block = plan.block_plans[0]
    assert (block.moe.path, block.moe.router, block.moe.experts) == (
        "sparse",
        "sparse.gate",
        "sparse.experts",
    )
    assert block.moe.num_experts == 3 and block.moe.shared_experts is None
    assert block.mlp is None  # the experts' w1/w2 are not a block MLP
    att = block.attention
    assert [p.path for p in att.column] == ["attn.query", "attn.key", "attn.value"]
    assert att.o.path == "attn.out_proj"
    assert (att.num_heads, att.num_kv_heads, att.head_dim) == (2, 2, 8)
    assert block.norms == ("ln",)
    assert plan.head is None and plan.final_norm == "ln_f"


def test_an_mlp_of_linears_is_not_a_transformer():
    with pytest.raises(ModelMappingError) as err:
        discover(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    message = str(err.value)
    assert "no token embedding found in Sequential" in message
    assert "no transformer blocks found in Sequential" in message
    assert "children: 0 (Linear), 1 (ReLU), 2 (Linear)" in message
    assert "parallel:\n  model_plan:\n" in message
    assert '"<blocks>": blocks' in message
    assert '"<blocks>.*.<attention>.<q_proj>": attention.q' in message


def test_missing_attention_snippet_uses_the_real_names():
    from plan_models import OddNet

    with pytest.raises(ModelMappingError) as err:
        discover(OddNet())
    message = str(err.value)
    assert "no attention projections found in block stack.0" in message
    assert "children: pre (LayerNorm), att (OddAttention), post (LayerNorm), ff (Sequential)" in message
    # Found parts appear with their real paths, missing ones as placeholders.
    assert '"tok": embedding' in message and '"stack": blocks' in message
    assert '"stack.*.<attention>.<o_proj>": attention.o' in message
    assert '"stack.*.pre": norm' in message and '"out": head' in message


def test_missing_head_count_asks_for_it():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(
                nn.ModuleDict({n: nn.Linear(8, 8) for n in ("q", "k", "v", "o")}) for _ in range(2)
            )

    # Only tensor parallelism cuts by heads: discovery notes the gap, tp refuses with the fix.
    bare = Bare()
    plan = discover(bare)
    assert plan.block_plans[0].attention.num_heads == 0
    assert any("no head count for attention" in note for note in plan.notes)
    with pytest.raises(ModelMappingError, match=r"model_plan=\{'blocks\.\*': 'attention\(heads=<N>\)'\}"):
        validate_tensor_parallel(plan, bare, 2)
    # Naming the block itself as the attention module is allowed.
    plan = discover(Bare(), {"blocks.*": "attention(heads=2)"})
    assert plan.block_plans[0].attention.path == ""
    assert plan.block_plans[0].attention.head_dim == 4
    assert any("no MLP or MoE" in note for note in plan.notes)
