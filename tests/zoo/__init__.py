"""A zoo of small causal LMs written in different styles, for testing that FiveDStrategy
takes a model as it is (issue 22). Each builds in a fraction of a second: hidden 64,
2 blocks, vocabulary 256 (the byte tokenizer of ``lightning_5d.models.TextDataModule``).

``build(name)`` returns a LightningModule whose ``training_step`` computes next-token cross
entropy from the batch's aligned labels (``zoo.adapter.ZooLM``). Seed before building
(``L.seed_everything(0)``) and every rank gets the same initial weights. The package is
imported as ``zoo``: put ``tests/`` on ``sys.path`` (tests/distributed/conftest.py does).

``MODELS`` maps each name to the module that builds it and one line on what makes it
different; the layout matrix over the zoo is tests/distributed/test_zoo_matrix.py.
"""

from __future__ import annotations

import importlib

from zoo.adapter import ZooLM

# name -> (module:function, what makes it different)
MODELS: dict[str, tuple[str, str]] = {
    "nanogpt": ("zoo.nanogpt:build", "nanoGPT: fused c_attn .split(n_embd, dim=2), view(B, T, C), blocks in a "
                "ModuleDict's ModuleList, own LayerNorm class, tied head"),
    "plain_torch": ("zoo.plain_torch:build", "plain PyTorch: view(b, s, -1, head_dim) with no head count, rotary "
                    "from arange inside attention, nn.RMSNorm, SwiGLU w1/w2/w3"),
    "direct_lm": ("zoo.direct_lm:build", "parameters on the LightningModule itself; grouped-query from shapes "
                  "(-1 heads, q.size // k.size), no position encoding"),
    "moduledict_layers": ("zoo.moduledict_layers:build", "layers in nn.ModuleDict keyed '0','1'; fused qkv "
                          ".chunk(3); positions as a raw nn.Parameter; nn.Sequential MLP"),
    "alternating": ("zoo.alternating:build", "one ModuleList alternating attention and MLP entries "
                    "(Residual(PreNorm(fn))); explicit softmax attention; norm+head in one nn.Sequential"),
    "torch_encoder": ("zoo.torch_encoder:build", "nn.TransformerEncoder(Layer) with a causal mask: "
                      "nn.MultiheadAttention (in_proj_weight), sinusoidal buffer, embedding scaled in forward"),
    "kwargs_forward": ("zoo.kwargs_forward:build", "keyword-only forwards at every level, rotary tables passed "
                       "down, q/k/v biases"),
    "nested_lists": ("zoo.nested_lists:build", "ModuleList of ModuleLists (for attn, ff in layers); fused "
                     "to_kv; ALiBi biases from a head count; norm inside the MLP Sequential"),
    "nested_blocks": ("zoo.nested_blocks:build", "nested_lists as its pp and sp refusals advise: each [attn, ff] "
                      "pair in a Block module with a forward"),
    "einops_style": ("zoo.einops_style:build", "einops: fused to_qkv .chunk(3), rearrange('b s (h d) -> b h s d', "
                     "h=self.heads), einsum attention with an explicit causal mask, learned positions"),
    "gpt_neox": ("zoo.hf_families:gpt_neox", "HF GPT-NeoX: fused query_key_value interleaved per head, "
                 "partial rotary (25 %), parallel residual"),
    "phi3": ("zoo.hf_families:phi3", "HF Phi-3: fused qkv_proj [q|k|v] (GQA) and gate_up_proj; head count read "
             "from config at forward time"),
    "olmo2": ("zoo.hf_families:olmo2", "HF OLMo-2: q/k RMSNorm over the full projection width; post-norms"),
    "qwen3": ("zoo.hf_families:qwen3", "HF Qwen3: q/k RMSNorm per head, GQA"),
    "gemma": ("zoo.hf_families:gemma", "HF Gemma: head_dim 32 != 64/4, embedding subclass scaling by "
              "sqrt(hidden), tied embeddings"),
}
# name -> (query heads, key/value heads): what a user fills into a model_plan's attention(...)
HEADS: dict[str, tuple[int, int]] = {
    "nanogpt": (4, 4), "plain_torch": (4, 4), "direct_lm": (4, 2), "moduledict_layers": (4, 4), "alternating": (4, 4),
    "torch_encoder": (4, 4), "kwargs_forward": (4, 4), "nested_lists": (4, 2), "nested_blocks": (4, 2), "einops_style": (4, 4), "gpt_neox": (4, 4), "phi3": (4, 2),
    "olmo2": (4, 2), "qwen3": (4, 2), "gemma": (4, 2),
}  # fmt: skip
HUGGING_FACE = ("gpt_neox", "phi3", "olmo2", "qwen3", "gemma")


def build(name: str) -> ZooLM:
    """The zoo model ``name`` in its LightningModule (random init from the current RNG state)."""
    if name not in MODELS:
        raise KeyError(f"no zoo model {name!r}; the zoo has {', '.join(MODELS)}")
    module, function = MODELS[name][0].split(":")
    return getattr(importlib.import_module(module), function)()
