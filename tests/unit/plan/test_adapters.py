"""Adapter-wrapped projections (plan/adapters.py): found by their shapes, and refused by discovery."""

import pytest
import torch
from torch import nn

from lightning_5d.models import LlamaConfig, LlamaModel
from lightning_5d.plan import ModelMappingError, discover
from lightning_5d.plan.adapters import adapter_wrapper, adapter_wrappers
from lightning_5d.plan.kinds import is_projection


class Linear(nn.Module):
    """peft's LoRA layer as it looks from outside (peft.tuners.lora.layer.Linear): a class named
    ``Linear`` with ``in_features`` / ``out_features``, a ``weight`` property returning its base's,
    ``base_layer``, ``lora_A`` / ``lora_B`` / ``lora_dropout`` ModuleDicts keyed by adapter, and
    the (empty) embedding and DoRA containers."""

    def __init__(self, base: nn.Linear, rank: int = 4, adapters=("default",)):
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, rank, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(rank, base.out_features, bias=False) for a in adapters})
        self.lora_dropout = nn.ModuleDict({a: nn.Dropout(0.0) for a in adapters})
        self.lora_embedding_A, self.lora_embedding_B = nn.ParameterDict(), nn.ParameterDict()
        self.lora_magnitude_vector = nn.ModuleDict()

    @property
    def weight(self) -> nn.Parameter:
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + sum(self.lora_B[a](self.lora_A[a](x)) for a in self.lora_A)


class Attention(nn.Module):  # grouped-query: k and v narrower than q
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16), nn.Linear(64, 64)


class LatentAttention(nn.Module):  # DeepSeek's MLA: q and kv through low-rank chains, no base beside them
    def __init__(self):
        super().__init__()
        self.q_a_proj, self.q_b_proj = nn.Linear(64, 16), nn.Linear(16, 4 * 24)
        self.kv_a_proj, self.kv_b_proj = nn.Linear(64, 16 + 8), nn.Linear(16, 4 * 32)
        self.o_proj = nn.Linear(4 * 16, 64)


def test_a_lora_layer_is_found_by_its_shapes_with_every_adapter():
    wrapper = adapter_wrapper("q_proj", Linear(nn.Linear(64, 32), rank=4, adapters=("default", "other")))
    assert wrapper.base == "base_layer" and wrapper.ranks == (4, 4) and wrapper.kind == "Linear"
    assert set(wrapper.branches) == {("lora_A.default", "lora_B.default"), ("lora_A.other", "lora_B.other")}
    assert "q_proj (Linear: linear base_layer with the low-rank branch lora_A.default -> lora_B.default (rank 4)" \
        in wrapper.describe()  # fmt: skip
    assert not is_projection(Linear(nn.Linear(64, 32)))  # its `weight` is its base's, not a parameter of its own


@pytest.mark.parametrize("module", [nn.Linear(64, 64), Attention(), LatentAttention(),
                                    nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64))])  # fmt: skip
def test_plain_layers_attention_mlp_and_low_rank_chains_are_not_adapters(module):
    assert adapter_wrapper("m", module) is None


def test_discovery_refuses_a_model_with_adapters_naming_them_and_what_trains_it():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                   num_kv_heads=2))  # fmt: skip
    for layer in model.layers:
        layer.attention.q_proj = Linear(layer.attention.q_proj)
        layer.attention.v_proj = Linear(layer.attention.v_proj)
    assert [w.path for w in adapter_wrappers(model)] == [f"layers.{i}.attention.{p}_proj" for i in (0, 1) for p in "qv"]
    explicit = {"layers.*.attention.q_proj.base_layer": "attention.q"}  # a model_plan pointing at the base
    for plan in (None, explicit):
        with pytest.raises(ModelMappingError, match=r"adapter-wrapped projections: layers\.0\.attention\.q_proj "
                                                    r"\(Linear: .*and 3 more.*zero=0\.\.3 needs no plan"):  # fmt: skip
            discover(model, plan)


def test_the_dry_run_counts_an_adapter_model_only_where_no_step_reads_the_plan():
    """Data parallelism alone counts a LoRA model discovery cannot map; where the job's steps read the
    plan (FP8 rewrites the linears: the recipe's dry run passes what its precision plugin says), the
    dry run refuses it as the real run does."""
    from lightning_5d.config import ParallelConfig, ZeroStage
    from lightning_5d.dimensions import combination_for
    from lightning_5d.dryrun.startup import startup_classes
    from lightning_5d.dryrun.state import StateRules

    def build():
        model = LlamaModel(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                       num_heads=4, num_kv_heads=2))  # fmt: skip
        model.requires_grad_(False)
        for layer in model.layers:
            layer.attention.q_proj = Linear(layer.attention.q_proj)
        return model

    config = ParallelConfig.from_mapping({"zero": 1, "dp_shard": "auto"})
    layout = config.resolve(2)
    combination = combination_for(config, layout, None, False)
    rules = StateRules(zero=ZeroStage.OPTIMIZER, low_precision_params=False)
    counted = startup_classes(build, config, layout, combination, rules)
    adapters = 2 * 2 * 4 * 64 * 4  # 2 layers x (A: 4 x 64, B: 64 x 4) fp32
    assert {c.state.grads for c in counted} == {adapters}
    with pytest.raises(ModelMappingError, match="adapter-wrapped projections"):
        startup_classes(build, config, layout, combination, rules, plan_needed=True)
