"""Small hand-written models that a plan can split wrongly without any error (issue 22).

Each is the reference Llama with one part written the way other code bases write it:

* ``ScaledEmbeddingLM``: an ``nn.Embedding`` subclass that multiplies its lookup by
  sqrt(hidden) (Gemma, T5-style); tp's vocabulary-parallel embedding replaces its forward
  with a plain lookup and loses the scale.
* ``FusedGateUpLM``: the MLP computes ``gate, up = gate_up_proj(x).chunk(2, -1)``
  (Phi-3 style); a plan that calls ``gate_up_proj`` a plain column projection cuts it into
  contiguous halves, so a rank's "gate" and "up" columns are the gate's two halves.
* ``NestedLM``: container blocks (``for attn, ff in self.layers``), its feed-forward a fused
  ``[gate|up]`` as above.
"""

import math
from dataclasses import asdict

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_5d.models import LlamaLM
from tests_support import MODELS, TINY


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * math.sqrt(self.embedding_dim)


class FusedGateUpMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MarkedLM(LlamaLM):
    """The reference model; counts the training steps that started (a broken plan must allow none)."""

    def __init__(self, config=TINY, **kwargs):
        super().__init__(config=asdict(config) if not isinstance(config, dict) else config, **kwargs)
        self.steps_started = 0

    def training_step(self, batch, batch_idx):
        self.steps_started += 1
        return super().training_step(batch, batch_idx)


class ScaledEmbeddingLM(MarkedLM):
    def __init__(self, config=TINY, **kwargs):
        super().__init__(config, **kwargs)
        old = self.model.embed_tokens
        with torch.no_grad():
            new = ScaledEmbedding(old.num_embeddings, old.embedding_dim)
            new.weight.copy_(old.weight)
        self.model.embed_tokens = new


class FusedGateUpLM(MarkedLM):
    # The plan our discovery error suggests for a fused MLP: one column and one row projection.
    PLAN = {
        "model.layers.*.mlp": "mlp",
        "model.layers.*.mlp.gate_up_proj": "mlp.column",
        "model.layers.*.mlp.down_proj": "mlp.row",
    }

    def __init__(self, config=TINY, **kwargs):
        super().__init__(config, **kwargs)
        cfg = self.model.config
        torch.manual_seed(7)
        for layer in self.model.layers:
            mlp = FusedGateUpMLP(cfg.hidden_size, cfg.intermediate_size)
            nn.init.normal_(mlp.gate_up_proj.weight, std=cfg.init_std)
            nn.init.normal_(mlp.down_proj.weight, std=cfg.init_std)
            layer.mlp = mlp


class InterleavedQKVAttention(nn.Module):
    """GPT-NeoX's layout: one ``qkv`` projection whose output columns are per head
    ``[q_h | k_h | v_h]``, not ``[q | k | v]``; no rotary, to keep it small."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).unbind(3)  # heads from the tensor (-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class InterleavedQKVLM(MarkedLM):
    # A plan that calls the fused projection [q|k|v]: right for GPT-2 or Phi-3, wrong here.
    PLAN = {
        "model.layers.*.attention": "attention(heads=4, kv_heads=4)",
        "model.layers.*.attention.qkv": "attention.qkv",
        "model.layers.*.attention.o_proj": "attention.o",
    }

    def __init__(self, config=MODELS["tiny_kv4"], **kwargs):
        super().__init__(config, **kwargs)
        cfg = self.model.config
        torch.manual_seed(11)
        for layer in self.model.layers:
            attention = InterleavedQKVAttention(cfg.hidden_size, cfg.num_heads)
            nn.init.normal_(attention.qkv.weight, std=cfg.init_std)
            nn.init.normal_(attention.o_proj.weight, std=cfg.init_std)
            layer.attention = attention


class HeadNormAttention(nn.Module):
    """Qwen3's q/k norm: an RMSNorm over each head's ``head_dim`` features, applied to q and k
    after the projections (no rotary, to keep it small). Under tp each rank's norm sees only its
    heads, so its weights' gradients are this rank's part of a sum over tp."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class HeadNormLM(MarkedLM):
    def __init__(self, config=MODELS["tiny_kv4"], **kwargs):
        super().__init__(config, **kwargs)
        cfg = self.model.config
        torch.manual_seed(13)
        for layer in self.model.layers:
            attention = HeadNormAttention(cfg.hidden_size, cfg.num_heads)
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj):
                nn.init.normal_(proj.weight, std=cfg.init_std)
            with torch.no_grad():  # not all ones: a wrong gradient should not hide behind a symmetric weight
                attention.q_norm.weight.uniform_(0.5, 1.5)
                attention.k_norm.weight.uniform_(0.5, 1.5)
            layer.attention = attention


class NestedAttention(nn.Module):
    """q/k/v/o attention; in its container block behind its pre-norm (``nn.Sequential(norm, attention)``),
    a sub-layer that returns only its update."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class NestedFeedForward(nn.Module):
    """The other sub-layer (behind its own pre-norm): a fused [gate|up] read with chunk(2), down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class NestedLM(L.LightningModule):
    """Container blocks: ``for attn, ff in self.layers``, each block an ``nn.ModuleList`` the
    model's loop opens (the style of many research code bases); no position encoding. The
    pre-norms sit outside the attention and feed-forward modules: tp does not sum the gradient
    of a norm inside its MLP region (the verifier stops such a plan: its gradient is this
    rank's columns' part)."""

    PLAN = {"layers.*.0.1": "attention(heads=4, kv_heads=4)"}

    def __init__(self, vocab: int = 256, hidden: int = 64, intermediate: int = 128, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(17)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Sequential(nn.LayerNorm(hidden), NestedAttention(hidden, 4)),
                           nn.Sequential(nn.LayerNorm(hidden), NestedFeedForward(hidden, intermediate))])
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.steps_started = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.lm_head(self.norm(x))

    def training_step(self, batch, batch_idx):
        self.steps_started += 1
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)
