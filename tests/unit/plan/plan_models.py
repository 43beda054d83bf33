"""Models shared by the discovery tests (imported as ``plan_models``)."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.models import LlamaConfig, LlamaModel

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
}
HF_SIZES = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class Wrapper(L.LightningModule):
    """A user's LightningModule holding the model as ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def reference(**overrides) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(**{**TINY, **overrides}))


def hf_model(family: str, **overrides) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, **overrides)
        return transformers.GPT2LMHeadModel(config)
    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    }[family]
    config = getattr(transformers, config_cls)(**{**HF_SIZES, **overrides})
    return getattr(transformers, model_cls)(config)


# ---------------------------------------------------------------- an oddly named model


class OddAttention(nn.Module):
    """Fused q|k|v under a name no table knows, softmax written out."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.wa = nn.Linear(hidden, 3 * hidden)
        self.wb = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, -1).transpose(1, 2) for t in self.wa(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)).softmax(dim=-1)
        return self.wb((scores @ v).transpose(1, 2).reshape(b, s, -1))


class OddBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(hidden)
        self.att = OddAttention(hidden)
        self.post = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.pre(x))
        return x + self.ff(self.post(x))


class OddNet(nn.Module):
    """Only an explicit plan can say where its attention projections are."""

    def __init__(self, vocab: int = 100, hidden: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.stack = nn.ModuleList(OddBlock(hidden) for _ in range(depth))
        self.final = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        for block in self.stack:
            h = block(h)
        return self.out(self.final(h))


ODD_PLAN = {
    "stack.*.att": "attention(heads=4)",
    "stack.*.att.wa": "attention.qkv",
    "stack.*.att.wb": "attention.o",
}


# ------------------------------------------------- Meta-style names, no config object


class MetaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MetaFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = MetaAttention(dim, n_heads=4, n_kv_heads=1)
        self.feed_forward = MetaFeedForward(dim, 3 * dim)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)


class MetaTransformer(nn.Module):
    """Names as in Meta's reference Llama code; no registry entry, no config object."""

    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MetaBlock(dim) for _ in range(depth))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
