"""What the planner needs to know about a model: its shape, not its weights.

A ``ModelSpec`` comes from a preset name, a Hugging Face ``config.json``, or a live
``nn.Module``/``LightningModule`` (its ``config`` attribute, else its structure). Symbols
used across the planner: V vocab, h hidden, f MLP intermediate, L layers, a query heads,
d head dim, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class ModelSpecError(ValueError):
    """The model's shape could not be determined; the message says how to supply it."""


class MlpKind(str, Enum):
    SWIGLU = "swiglu"  # gate, up, down: 3 matrices of h x f (Llama, Mixtral)
    GELU = "gelu"  # fc1, fc2: 2 matrices of h x f (GPT-3, the Megatron papers)


class NormKind(str, Enum):
    RMSNORM = "rmsnorm"  # weight only
    LAYERNORM = "layernorm"  # weight and bias


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    MoE convention: ``num_experts > 0`` makes every layer's MLP a routed MoE of
    ``num_experts`` experts of width ``moe_intermediate_size`` (default: ``intermediate_size``,
    as in Mixtral), plus ``num_shared_experts`` always-on experts of width
    ``shared_expert_intermediate_size`` each (default: ``moe_intermediate_size``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (plain multi-head attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_top_k: int = 0
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    max_seq_len: int = 4096
    mlp: MlpKind = MlpKind.SWIGLU
    norm: NormKind = NormKind.RMSNORM
    bias: bool = False  # biases on every linear (GPT-style)
    learned_positions: bool = False  # a max_seq_len x h position table instead of RoPE
    dropout: bool = False  # dropout after attention scores and each residual branch (KOR's model has it)
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, f) < 1:
                raise ModelSpecError(f"{f}={getattr(self, f)} must be >= 1.")
        object.__setattr__(self, "mlp", MlpKind(self.mlp))
        object.__setattr__(self, "norm", NormKind(self.norm))
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                f"grouped-query attention needs each kv head shared by the same number of query heads."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ModelSpecError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; pass head_dim."
            )
        if self.num_experts and not 1 <= self.experts_top_k <= self.num_experts:
            raise ModelSpecError(
                f"experts_top_k={self.experts_top_k} must be in 1..num_experts={self.num_experts} for an MoE model."
            )

    # Resolved shape (the paper symbols), so callers never repeat the defaults' logic.
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_width(self) -> int:
        """a*d: width of the query (and attention output) projection."""
        return self.num_heads * self.d_head

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.d_head

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_width(self) -> int:
        """Total width of the always-on shared experts (0 without)."""
        if not self.num_shared_experts:
            return 0
        return self.num_shared_experts * (self.shared_expert_intermediate_size or self.expert_width)

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)


_LLAMA3 = dict(vocab_size=128256, num_kv_heads=8, max_seq_len=8192)

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="llama3-8b",
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            **_LLAMA3,
        ),
        ModelSpec(
            name="llama3-70b",
            hidden_size=8192,
            intermediate_size=28672,
            num_layers=80,
            num_heads=64,
            **_LLAMA3,
        ),
        ModelSpec(
            name="llama3-405b",
            hidden_size=16384,
            intermediate_size=53248,
            num_layers=126,
            num_heads=128,
            **_LLAMA3,
        ),
        ModelSpec(
            name="mixtral-8x7b",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            num_experts=8,
            experts_top_k=2,
            max_seq_len=32768,
        ),
    )
}


def _reference_presets() -> dict[str, ModelSpec]:
    """The reference model's recipes (conf/model/tiny*.yaml): the LlamaConfig defaults."""
    from lightning_5d.models.llama import LlamaConfig

    tiny = spec_from_config_object(LlamaConfig(), name="l5d-tiny")
    moe = dataclasses.replace(tiny, name="l5d-tiny-moe", num_experts=4, experts_top_k=2, moe_intermediate_size=192)
    return {tiny.name: tiny, moe.name: moe}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ModelSpecError(
            f"unknown model preset {name!r}; presets: {sorted(PRESETS)}; or pass a path to a "
            f"Hugging Face config.json (or the folder holding it)."
        ) from None


# Hugging Face key -> ModelSpec field. Several families name the same thing differently.
_HF_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
    "tie_embeddings": ("tie_word_embeddings",),
    "num_experts": ("num_local_experts", "n_routed_experts", "num_experts"),
    "experts_top_k": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "num_shared_experts": ("n_shared_experts", "num_shared_experts"),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "max_seq_len": ("max_position_embeddings", "n_positions"),
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")


def spec_from_hf_config(source: str | os.PathLike | Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (path, folder holding it, or the parsed dict)."""
    if isinstance(source, Mapping):
        cfg, label = dict(source), name or str(source.get("model_type", "hf-config"))
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        label = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-config"
    # Multimodal configs keep the language model's shape in a nested section.
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    values: dict[str, Any] = {}
    for field_name, keys in _HF_KEYS.items():
        for key in keys:
            if cfg.get(key) is not None:
                values[field_name] = cfg[key]
                break
    if values.get("tie_embeddings") is None:
        values["tie_embeddings"] = False  # transformers' default is True, but Llama/Mixtral say so explicitly
    # Qwen-MoE style: one shared expert described only by its width.
    if values.get("shared_expert_intermediate_size") and not values.get("num_shared_experts"):
        values["num_shared_experts"] = 1
    if cfg.get("model_type") == "gpt2":  # GPT-2: GeLU MLP of 4h, LayerNorm, biases, learned positions
        values.setdefault("intermediate_size", 4 * values["hidden_size"])
        values.update(
            mlp=MlpKind.GELU, norm=NormKind.LAYERNORM, bias=True, learned_positions=True, dropout=True
        )
        values["tie_embeddings"] = cfg.get("tie_word_embeddings", True)
    missing = [f for f in _REQUIRED if f not in values]
    if missing:
        raise ModelSpecError(
            f"config {label!r} lacks {missing} (looked for keys {[_HF_KEYS[f] for f in missing]}); "
            f"add them to the config.json or use a preset ({sorted(PRESETS)})."
        )
    return ModelSpec(name=label, **values)


# Field names of lightning_5d.models.llama.LlamaConfig (and most dataclass configs).
_SPEC_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}


def spec_from_config_object(config: Any, name: str | None = None) -> ModelSpec:
    """A dataclass config using ModelSpec's field names, or a transformers ``PretrainedConfig``."""
    if hasattr(config, "to_dict") and not dataclasses.is_dataclass(config):
        return spec_from_hf_config(config.to_dict(), name=name or getattr(config, "model_type", None))
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    if not any(k in values for k in _REQUIRED) and any(k in values for k in ("num_hidden_layers", "n_layer")):
        return spec_from_hf_config(values, name=name)
    kept = {k: v for k, v in values.items() if k in _SPEC_FIELDS and k != "name" and v is not None}
    missing = [f for f in _REQUIRED if f not in kept]
    if missing:
        raise ModelSpecError(f"{type(config).__name__} lacks {missing}; " + _HOW_TO_PASS)
    return ModelSpec(name=name or type(config).__name__, **kept)


_HOW_TO_PASS = (
    "pass the shape explicitly: a preset name (e.g. `l5d estimate --model llama3-8b`, "
    f"presets: {sorted(PRESETS)}), a Hugging Face config.json path, or "
    "`spec_from_module(module, num_heads=..., num_kv_heads=...)` with the missing fields."
)


def spec_from_module(module: Any, **overrides: Any) -> ModelSpec:
    """Shape of a LightningModule / nn.Module.

    Looks for a ``config`` attribute on the module or its ``.model``; otherwise infers what it
    can from the structure (embedding -> V, h; the longest ModuleList -> L; MLP linears -> f)
    and raises ``ModelSpecError`` naming whatever is still unknown (head counts cannot be
    read from weight shapes). ``overrides`` fill or replace any field.
    """
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None) if owner is not None else None
        if config is not None and (dataclasses.is_dataclass(config) or hasattr(config, "to_dict")):
            spec = spec_from_config_object(config, name=type(owner).__name__)
            return spec.replace(**overrides) if overrides else spec
    inferred = _infer_from_structure(module)
    inferred.update(overrides)
    missing = [f for f in _REQUIRED if f not in inferred]
    if missing:
        counted = sum(p.numel() for p in module.parameters()) if hasattr(module, "parameters") else 0
        known = {k: v for k, v in inferred.items() if k in _REQUIRED}
        raise ModelSpecError(
            f"{type(module).__name__} has no `config` attribute; counted {counted:,} parameters and "
            f"inferred {known or 'nothing'}, but could not infer {missing}. " + _HOW_TO_PASS
        )
    inferred.setdefault("name", type(module).__name__)
    return ModelSpec(**{k: v for k, v in inferred.items() if k in _SPEC_FIELDS})


def _infer_from_structure(module: Any) -> dict[str, Any]:
    from torch import nn

    out: dict[str, Any] = {}
    if not isinstance(module, nn.Module):
        return out
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        out["vocab_size"], out["hidden_size"] = embeddings[0].weight.shape
    blocks = max((m for m in module.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if blocks is not None and len(blocks) > 0:
        out["num_layers"] = len(blocks)
        block = blocks[0]
        for attr, field_name in (
            ("num_heads", "num_heads"),
            ("n_heads", "num_heads"),
            ("num_kv_heads", "num_kv_heads"),
            ("n_kv_heads", "num_kv_heads"),
        ):
            for sub in block.modules():
                if isinstance(getattr(sub, attr, None), int):
                    out.setdefault(field_name, getattr(sub, attr))
        widths = [
            m.out_features
            for n, m in block.named_modules()
            if isinstance(m, nn.Linear) and any(k in n for k in ("up", "gate", "fc1", "w1", "w3"))
        ]
        if widths:
            out["intermediate_size"] = max(widths)
    return out


def load_spec(model: Any, **overrides: Any) -> ModelSpec:
    """Preset name, config.json path/folder, ModelSpec, or a module instance -> ModelSpec."""
    if isinstance(model, ModelSpec):
        spec = model
    elif isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if os.path.exists(text):
            spec = spec_from_hf_config(text)
        else:
            spec = get_preset(text)
    else:
        return spec_from_module(model, **overrides)
    return spec.replace(**overrides) if overrides else spec


PRESETS.update(_reference_presets())
