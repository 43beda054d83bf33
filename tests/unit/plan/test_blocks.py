"""Blocks in any indexed container, and what each dimension needs from a plain model (issue 22)."""

import pytest
import torch.nn.functional as F
from torch import nn

from lightning_5d.parallel.tensor.validate import validate_tensor_parallel
from lightning_5d.plan import ModelMappingError, discover, find_blocks

HIDDEN, D = 16, 4


class Attention(nn.Module):
    """Keeps no head count: reshapes with -1."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Plain(nn.Module):
    def __init__(self, container: str = "list") -> None:
        super().__init__()
        self.container = container
        self.embed = nn.Embedding(40, HIDDEN)
        if container == "dict":
            self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})
        elif container == "nested":
            self.layers = nn.ModuleList(nn.ModuleList([Attention(), MLP()]) for _ in range(3))
        else:
            self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, 40)

    def forward(self, ids):
        x = self.embed(ids)
        if self.container == "nested":
            for attn, mlp in self.layers:
                x = x + attn(x)
                x = x + mlp(x)
        else:
            for block in self.layers.values() if self.container == "dict" else self.layers:
                x = block(x)
        return self.lm_head(self.norm(x))


@pytest.mark.parametrize("container", ["list", "dict", "nested"])
def test_blocks_are_found_in_any_indexed_container(container):
    model = Plain(container)
    path, blocks = find_blocks(model)
    assert path == "layers" and len(blocks) == 3
    plan = discover(model)
    assert plan.blocks == "layers" and plan.num_blocks == 3
    assert plan.blocks_of(model) == blocks
    attention = plan.block_plans[0].attention
    assert attention.o.path.endswith("o_proj") and plan.block_plans[0].mlp is not None


def test_a_module_dict_that_is_not_indexed_is_not_a_block_list():
    model = Plain("dict")
    model.layers = nn.ModuleDict({"first": Block(), "second": Block()})
    assert find_blocks(model) == ("", [])


def test_no_head_count_is_a_note_for_every_dimension_but_tp():
    model = Plain()
    plan = discover(model)  # cp, pp, FP8 and ZeRO read this plan without a head count
    assert plan.block_plans[0].attention.num_heads == 0
    with pytest.raises(ModelMappingError, match="attention\\(heads=<N>\\)"):
        validate_tensor_parallel(plan, model, 2)


def test_the_suggested_model_plan_is_accepted():
    model = Plain()
    plan = discover(model, {"layers.*.attn": "attention(heads=4)"})
    attention = plan.block_plans[2].attention
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 4, D)
    validate_tensor_parallel(plan, model, 2)  # no refusal


def test_the_suggested_model_plan_is_accepted_for_a_module_dict():
    plan = discover(Plain("dict"), {"layers": "blocks", "layers.*.attn": "attention(heads=4)"})
    assert plan.blocks == "layers" and plan.block_plans[0].attention.num_heads == 4


def test_a_model_with_no_position_information_is_observed_as_such():
    plan = discover(Plain())  # more cases: tests/unit/plan/test_position_reads.py
    assert plan.uses_positions is False and plan.position_reads == ()


def test_the_planner_reads_a_config_less_model_from_discovery():
    from lightning_5d.auto_layout import _model_spec
    from lightning_5d.config import ParallelConfig

    spec = _model_spec(Plain("dict"), ParallelConfig())  # no config object, blocks in a ModuleDict
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers, spec.intermediate_size) == (40, HIDDEN, 3, 32)
    assert spec.num_heads == 1  # unknown head count: tp cannot be chosen, every other dimension can
    told = _model_spec(Plain("dict"), ParallelConfig(model_plan={"layers.*.attn": "attention(heads=4)"}))
    assert told.num_heads == 4
