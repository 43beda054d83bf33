"""Mixture-of-experts discovery: Hugging Face 5.x grouped experts (Mixtral, Qwen2-MoE with its
shared expert), the reference Llama's expert lists, a generic router + expert list, and the
explicit plan on all of them."""

import pytest
import torch
from plan_models import Wrapper
from torch import nn

from lightning_5d.models import LlamaConfig, LlamaLM
from lightning_5d.plan import (
    ExpertsKind,
    ModelMappingError,
    MoEPlan,
    PlanConflictError,
    PlanSource,
    Role,
    describe,
    discover,
)
from lightning_5d.plan.roles import parse_role

HF_TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def mixtral(**overrides) -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**{**HF_TINY, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
    return transformers.MixtralForCausalLM(config)


def qwen2_moe(**overrides) -> nn.Module:
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        **{
            **HF_TINY,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            **overrides,
        }
    )
    return transformers.Qwen2MoeForCausalLM(config)


def reference_lm(**overrides) -> LlamaLM:
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
    return LlamaLM(LlamaConfig(**{**sizes, "num_experts": 4, "experts_top_k": 2, **overrides}))


MIXTRAL_MOE = MoEPlan(
    path="mlp",
    router="mlp.gate",
    experts="mlp.experts",
    num_experts=4,
    experts_kind=ExpertsKind.GROUPED,
    top_k=2,
)
QWEN2_MOE = MoEPlan(
    path="mlp",
    router="mlp.gate",
    experts="mlp.experts",
    num_experts=4,
    shared_experts="mlp.shared_expert",
    experts_kind=ExpertsKind.GROUPED,
    top_k=2,
    shared_expert_gate="mlp.shared_expert_gate",
)


# ---------------------------------------------------------------- Hugging Face 5.x


def test_mixtral_grouped_experts_from_the_published_ep_plan():
    model = mixtral()
    plan = discover(model)
    assert plan.source is PlanSource.PUBLISHED and plan.has_moe
    for block in plan.block_plans:
        assert block.moe == MIXTRAL_MOE
        assert block.mlp is None
    assert block.norms == ("input_layernorm", "post_attention_layernorm")
    assert not any("counterpart" in note or "no MLP or MoE" in note for note in plan.notes)
    # The published plan alone says where the whole MoE is (no router entry in it).
    assert discover(model, sources=[PlanSource.PUBLISHED]).block_plans[0].moe == MIXTRAL_MOE


def test_mixtral_structurally_and_wrapped():
    model = mixtral(num_experts_per_tok=3)
    structural = discover(model, sources=[PlanSource.STRUCTURAL])
    assert structural.block_plans[0].moe.experts_kind is ExpertsKind.GROUPED
    assert structural.block_plans[0].moe.top_k == 3
    wrapped = discover(Wrapper(model))
    assert wrapped.blocks == "model.model.layers"
    assert wrapped.block_plans == discover(model).block_plans == structural.block_plans


def test_qwen2_moe_shared_expert_belongs_to_the_moe():
    plan = discover(qwen2_moe())
    assert plan.source is PlanSource.PUBLISHED
    for block in plan.block_plans:
        assert block.moe == QWEN2_MOE
        # The shared expert's gate/up/down are not a dense block MLP for TP to shard.
        assert block.mlp is None
    text = describe(plan)
    assert "experts           mlp.experts (4 experts, grouped)" in text
    assert "top_k             2" in text
    assert "shared experts    mlp.shared_expert (gate mlp.shared_expert_gate)" in text


def test_qwen2_moe_dense_layers_keep_their_mlp():
    plan = discover(qwen2_moe(mlp_only_layers=[0]))
    dense, sparse = plan.block_plans
    assert dense.moe is None and dense.mlp.path == "mlp"
    assert [p.path for p in dense.mlp.column] == ["mlp.gate_proj", "mlp.up_proj"]
    assert sparse.moe == QWEN2_MOE and sparse.mlp is None
    assert discover(qwen2_moe(), sources=[PlanSource.STRUCTURAL]).block_plans[0].moe == QWEN2_MOE


def test_a_tp_plan_that_shards_the_shared_expert_does_not_make_it_the_block_mlp():
    # DeepSeek-V3 publishes colwise/rowwise entries for `mlp.shared_experts.*`.
    model = qwen2_moe()
    shared = {f"layers.*.mlp.shared_expert.{n}": "colwise" for n in ("gate_proj", "up_proj")}
    shared["layers.*.mlp.shared_expert.down_proj"] = "rowwise"
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, **shared}
    plan = discover(model)
    assert plan.block_plans[0].moe == QWEN2_MOE and plan.block_plans[0].mlp is None
    assert "MLP mlp.shared_expert is inside MoE mlp; left to the MoE" in plan.notes


def test_mixtral_router_of_the_wrong_size_is_reported():
    model = mixtral()
    model.model.layers[1].mlp.gate.weight = nn.Parameter(torch.zeros(3, 32))
    with pytest.raises(ModelMappingError, match="router mlp.gate scores 3 experts but mlp.experts holds 4"):
        discover(model)


# ---------------------------------------------------------------- reference Llama


@pytest.mark.parametrize("shared", [0, 1], ids=["routed-only", "shared-experts"])
def test_reference_moe(shared):
    lm = reference_lm(num_shared_experts=shared, experts_top_k=3)
    plan = discover(lm)
    assert plan.source is PlanSource.REGISTRY
    expected = MoEPlan(
        path="moe",
        router="moe.router",
        experts="moe.experts",
        num_experts=4,
        shared_experts="moe.shared_experts" if shared else None,
        experts_kind=ExpertsKind.MODULE_LIST,
        top_k=3,
    )
    assert [b.moe for b in plan.block_plans] == [expected, expected]
    assert all(b.mlp is None for b in plan.block_plans)
    assert discover(lm, sources=[PlanSource.STRUCTURAL]).block_plans == plan.block_plans


def test_router_scoring_other_than_the_experts_is_an_error():
    lm = reference_lm()
    lm.model.layers[0].moe.router = nn.Linear(32, 3, bias=False)
    with pytest.raises(ModelMappingError) as err:
        discover(lm)
    message = str(err.value)
    assert "in block model.layers.0, router moe.router scores 3 experts but moe.experts holds 4" in message
    assert '"model.layers.*.moe.router": moe.router' in message


# ---------------------------------------------------------------- a generic MoE


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)


class ToyMoE(nn.Module):
    def __init__(self, dim: int, experts: int, router_name: str = "router") -> None:
        super().__init__()
        self.add_module(router_name, nn.Linear(dim, experts, bias=False))
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, router_name: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.n_heads = 4
        self.attn.wq, self.attn.wk, self.attn.wv, self.attn.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.ffn = ToyMoE(dim, 6, router_name)


class ToyConfig:
    num_experts_per_tok = 2


class ToyNet(nn.Module):
    def __init__(self, dim: int = 32, router_name: str = "router", config: object | None = None) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.tok_embeddings = nn.Embedding(128, dim)
        self.layers = nn.ModuleList(ToyBlock(dim, router_name) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, 128, bias=False)


@pytest.mark.parametrize("router_name", ["router", "gate", "switch"])
def test_generic_router_beside_an_expert_list(router_name):
    plan = discover(ToyNet(router_name=router_name))
    assert plan.source is PlanSource.STRUCTURAL
    block = plan.block_plans[0]
    assert block.moe == MoEPlan(
        path="ffn",
        router=f"ffn.{router_name}",
        experts="ffn.experts",
        num_experts=6,
        experts_kind=ExpertsKind.MODULE_LIST,
        top_k=0,  # neither the modules nor a config say
    )
    assert block.mlp is None and block.norms == ("norm1", "norm2")
    assert "top_k             unknown" in describe(plan)


def test_generic_top_k_from_the_config():
    assert discover(ToyNet(config=ToyConfig())).block_plans[0].moe.top_k == 2


def test_generic_router_of_the_wrong_size_is_no_moe():
    # Unnamed by any plan, a linear layer is a router only if it scores every expert.
    model = ToyNet(router_name="switch")
    for block in model.layers:
        block.ffn.switch = nn.Linear(32, 5, bias=False)
    assert not discover(model).has_moe


# ---------------------------------------------------------------- explicit plans


def test_explicit_plan_names_grouped_experts_and_a_non_linear_router():
    model = mixtral()
    plan = discover(
        model,
        {
            "model.layers.*.mlp": "moe",
            "model.layers.*.mlp.gate": "moe.router",
            "model.layers.*.mlp.experts": "moe.experts",
        },
    )
    assert plan.source is PlanSource.EXPLICIT
    assert plan.block_plans[0].moe == MIXTRAL_MOE


def test_explicit_shared_expert_gate_role():
    assert parse_role("moe.shared_expert_gate").role is Role.SHARED_EXPERT_GATE
    plan = discover(
        qwen2_moe(),
        {
            "model.layers.*.mlp.experts": "moe.experts",
            "model.layers.*.mlp.shared_expert": "moe.shared_experts",
            "model.layers.*.mlp.shared_expert_gate": "moe.shared_expert_gate",
        },
    )
    assert plan.block_plans[0].moe == QWEN2_MOE


@pytest.mark.parametrize(
    ("pattern", "role", "needs"),
    [
        ("model.layers.*.input_layernorm", "moe.router", "a linear layer or a module with a 2-D weight"),
        ("model.layers.*.self_attn.q_proj", "moe.experts", "an nn.ModuleList of experts or a module holding"),
        ("model.layers.*.mlp.gate", "moe.shared_expert_gate", "a linear layer"),
    ],
)
def test_explicit_moe_roles_on_the_wrong_kind(pattern, role, needs):
    with pytest.raises(PlanConflictError, match=f"gives role '{role}' to .*; that role needs {needs}"):
        discover(mixtral(), {pattern: role})
