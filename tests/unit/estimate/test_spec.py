"""Model input: presets, Hugging Face config.json, module introspection, and counts checked against real modules."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from lightning_5d.models import LlamaConfig
from lightning_5d.estimate import (
    PRESETS,
    ModelSpec,
    ModelSpecError,
    count_params,
    get_preset,
    load_spec,
    spec_from_hf_config,
    spec_from_module,
)


def test_required_presets_exist():
    for name in ("llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "l5d-tiny", "l5d-tiny-moe"):
        assert name in PRESETS


def test_reference_model_recipes():
    tiny = get_preset("l5d-tiny")
    assert (tiny.vocab_size, tiny.hidden_size, tiny.intermediate_size, tiny.num_layers) == (256, 128, 384, 4)
    assert (tiny.num_heads, tiny.num_kv_heads, tiny.max_seq_len, tiny.tie_embeddings) == (8, 4, 256, False)
    moe = get_preset("l5d-tiny-moe")
    assert (moe.num_experts, moe.experts_top_k, moe.moe_intermediate_size) == (4, 2, 192)
    assert (
        dataclasses.replace(moe, name="l5d-tiny", num_experts=0, experts_top_k=tiny.experts_top_k, moe_intermediate_size=None)
        == tiny
    )


def test_published_totals_of_larger_presets():
    assert count_params(get_preset("llama3-405b")).total == 405_853_388_800
    mixtral = count_params(get_preset("mixtral-8x7b"))
    assert mixtral.total == 46_702_792_704  # "46.7B"
    assert mixtral.active == pytest.approx(12.9e9, rel=1e-2)  # "12.9B active"


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ModelSpecError, match="llama3-8b"):
        get_preset("llama-9000")


def test_hf_config_json(tmp_path):
    cfg = {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
    }
    folder = tmp_path / "mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    for source in (folder / "config.json", folder, str(folder / "config.json")):
        spec = load_spec(source)
        assert count_params(spec).total == count_params(get_preset("mixtral-8x7b")).total
    assert spec.name == "mixtral"


def test_hf_config_shared_expert_and_missing_keys():
    qwen_moe = {
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 128,
    }
    spec = spec_from_hf_config(qwen_moe)
    assert (spec.num_shared_experts, spec.shared_width, spec.expert_width) == (1, 128, 32)
    with pytest.raises(ModelSpecError, match="num_layers"):
        spec_from_hf_config(
            {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2}
        )


# --- a real Llama-style module, to check the counter against numel() ----------------------


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class SwiGLU(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(h, f, bias=False),
            nn.Linear(h, f, bias=False),
            nn.Linear(f, h, bias=False),
        )


class Block(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        h, d = s.hidden_size, s.d_head
        self.q = nn.Linear(h, s.num_heads * d, bias=False)
        self.k = nn.Linear(h, s.kv_heads * d, bias=False)
        self.v = nn.Linear(h, s.kv_heads * d, bias=False)
        self.o = nn.Linear(s.num_heads * d, h, bias=False)
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        if s.is_moe:
            self.router = nn.Linear(h, s.num_experts, bias=False)
            self.experts = nn.ModuleList(SwiGLU(h, s.expert_width) for _ in range(s.num_experts))
            self.shared = SwiGLU(h, s.shared_width) if s.shared_width else None
        else:
            self.mlp = SwiGLU(h, s.intermediate_size)


class TinyLlama(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size)
        self.head = None if s.tie_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)


def numel(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    "spec",
    [
        get_preset("l5d-tiny"),
        get_preset("l5d-tiny-moe"),
        get_preset("l5d-tiny").replace(tie_embeddings=True, num_kv_heads=2),
        get_preset("l5d-tiny-moe").replace(num_shared_experts=2),
    ],
    ids=["tiny", "tiny-moe", "tied-gqa2", "moe-shared"],
)
def test_counter_matches_a_real_module(spec):
    assert count_params(spec).total == numel(TinyLlama(spec))


class FakeLightningModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = nn.Linear(2, 2)
        self.model.config = config


def test_module_with_dataclass_config_on_model_attribute():
    spec = spec_from_module(FakeLightningModule(LlamaConfig()))
    assert count_params(spec).total == count_params(get_preset("l5d-tiny")).total
    moe = spec_from_module(FakeLightningModule(LlamaConfig(num_experts=4, moe_intermediate_size=192)))
    assert count_params(moe).total == count_params(get_preset("l5d-tiny-moe")).total


def test_module_with_hf_style_config():
    class HFConfig:
        model_type = "llama"

        def to_dict(self):
            return {
                "vocab_size": 256,
                "hidden_size": 128,
                "intermediate_size": 384,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "tie_word_embeddings": False,
            }

    module = nn.Linear(1, 1)
    module.config = HFConfig()
    assert count_params(spec_from_module(module)).total == count_params(get_preset("l5d-tiny")).total


@pytest.mark.parametrize(
    "preset, changes",
    [
        ("l5d-tiny", {}),
        ("l5d-tiny-moe", {}),
        ("l5d-tiny-moe", {"num_shared_experts": 1}),
        ("l5d-tiny", {"tie_embeddings": True}),
    ],
    ids=["tiny", "tiny-moe", "moe-shared", "tied"],
)
def test_reference_lightning_module(preset, changes):
    """The real reference model (skipped until it exists): read from its config, counted like numel()."""
    llama = pytest.importorskip("lightning_5d.models.llama")
    spec = get_preset(preset).replace(**changes)
    fields = {f.name for f in dataclasses.fields(llama.LlamaConfig)}
    config = {k: v for k, v in dataclasses.asdict(spec).items() if k in fields and v is not None}
    module = llama.LlamaLM(llama.LlamaConfig(**config))
    read = spec_from_module(module)
    assert count_params(read).total == numel(module) == count_params(spec).total


def test_structural_fallback_names_what_it_could_not_infer():
    spec = get_preset("l5d-tiny")
    module = TinyLlama(spec)
    with pytest.raises(ModelSpecError) as err:
        spec_from_module(module)
    text = str(err.value)
    assert f"{numel(module):,}" in text  # it counted the parameters
    assert "num_heads" in text and "llama3-8b" in text and "config.json" in text
    # Given the head counts, the structure is enough.
    inferred = spec_from_module(module, num_heads=8, num_kv_heads=4)
    assert (inferred.vocab_size, inferred.hidden_size, inferred.num_layers, inferred.intermediate_size) == (
        256,
        128,
        4,
        384,
    )
    assert count_params(inferred).total == numel(module)


def test_structural_fallback_reads_head_attributes():
    spec = get_preset("l5d-tiny")
    module = TinyLlama(spec)
    for block in module.layers:
        block.num_heads, block.num_kv_heads = 8, 4
    inferred = spec_from_module(module)
    assert count_params(inferred).total == numel(module)
