"""The third source: role names of architectures known by their class.

An entry's patterns are relative to the module of that class, wherever it sits in the
tree (``self.model = GPT2LMHeadModel(...)`` in a LightningModule just adds ``model.``).
Entries name every optional part (``lm_head``, ``moe``, ``shared_experts``); a model
without one simply does not match that pattern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_5d.plan import paths
from lightning_5d.plan.heads import from_configs
from lightning_5d.plan.patterns import RoleMap
from lightning_5d.plan.roles import parse_role


@dataclass(frozen=True)
class KnownArchitecture:
    class_name: str
    module_prefix: str  # the defining module's name starts with this (two libraries, one class name)
    roles: Mapping[str, str]  # pattern (relative to the module of this class) -> role

    def matches(self, module: nn.Module) -> bool:
        cls = type(module)
        return cls.__name__ == self.class_name and cls.__module__.startswith(self.module_prefix)


def _hf_decoder(base: str) -> dict[str, str]:
    """The layout Llama, Mistral and Qwen2 share in transformers (base: the decoder's path)."""
    layer = paths.join(base, "layers.*")
    return {
        paths.join(base, "embed_tokens"): "embedding",
        paths.join(base, "layers"): "blocks",
        paths.join(base, "norm"): "final_norm",
        "lm_head": "head",
        f"{layer}.self_attn": "attention",
        f"{layer}.self_attn.q_proj": "attention.q",
        f"{layer}.self_attn.k_proj": "attention.k",
        f"{layer}.self_attn.v_proj": "attention.v",
        f"{layer}.self_attn.o_proj": "attention.o",
        f"{layer}.mlp": "mlp",
        f"{layer}.mlp.gate_proj": "mlp.column",
        f"{layer}.mlp.up_proj": "mlp.column",
        f"{layer}.mlp.down_proj": "mlp.row",
        f"{layer}.input_layernorm": "norm",
        f"{layer}.post_attention_layernorm": "norm",
    }


def _gpt2(base: str) -> dict[str, str]:
    block = paths.join(base, "h.*")
    return {
        paths.join(base, "wte"): "embedding",
        paths.join(base, "wpe"): "position_embedding",
        paths.join(base, "h"): "blocks",
        paths.join(base, "ln_f"): "final_norm",
        "lm_head": "head",
        f"{block}.attn": "attention",
        f"{block}.attn.c_attn": "attention.qkv",
        f"{block}.attn.c_proj": "attention.o",
        f"{block}.mlp": "mlp",
        f"{block}.mlp.c_fc": "mlp.column",
        f"{block}.mlp.c_proj": "mlp.row",
        f"{block}.ln_1": "norm",
        f"{block}.ln_2": "norm",
    }


_REFERENCE_LLAMA = {
    "embed_tokens": "embedding",
    "layers": "blocks",
    "norm": "final_norm",
    "lm_head": "head",
    "layers.*.attention": "attention",
    "layers.*.attention.q_proj": "attention.q",
    "layers.*.attention.k_proj": "attention.k",
    "layers.*.attention.v_proj": "attention.v",
    "layers.*.attention.o_proj": "attention.o",
    "layers.*.mlp": "mlp",
    "layers.*.mlp.gate_proj": "mlp.column",
    "layers.*.mlp.up_proj": "mlp.column",
    "layers.*.mlp.down_proj": "mlp.row",
    "layers.*.moe": "moe",
    "layers.*.moe.router": "moe.router",
    "layers.*.moe.experts": "moe.experts",
    "layers.*.moe.shared_experts": "moe.shared_experts",
    "layers.*.attention_norm": "norm",
    "layers.*.mlp_norm": "norm",
}

KNOWN_ARCHITECTURES: tuple[KnownArchitecture, ...] = (
    KnownArchitecture("LlamaModel", "lightning_5d.", _REFERENCE_LLAMA),
    *(
        KnownArchitecture(f"{family}{suffix}", "transformers.", _hf_decoder(base))
        for family in ("Llama", "Mistral", "Qwen2")
        for suffix, base in (("ForCausalLM", "model"), ("Model", ""))
    ),
    KnownArchitecture("GPT2LMHeadModel", "transformers.", _gpt2("transformer")),
    KnownArchitecture("GPT2Model", "transformers.", _gpt2("")),
)


def find(root: nn.Module) -> RoleMap:
    """Roles for the outermost module of a known class inside ``root`` (empty if none)."""
    for prefix, module in root.named_modules():
        for known in KNOWN_ARCHITECTURES:
            if known.matches(module):
                roles = {
                    paths.join(prefix, pattern): parse_role(role, pattern) for pattern, role in known.roles.items()
                }
                note = f"known architecture {known.class_name} at {prefix or '(root)'}"
                return RoleMap(roles, from_configs(root, prefix), (note,))
    return RoleMap({})
