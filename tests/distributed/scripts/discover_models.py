"""Hand-written causal LMs in styles discovery used to get wrong (issue 22), and a one-process reference.

Each ``Style`` changes one thing about an otherwise ordinary pre-norm transformer:

- PLAIN: attention reshapes with ``view(b, s, -1, head_dim)`` and keeps no head count;
  embedding, blocks (an ``nn.ModuleList``), final norm and head are direct attributes of the
  LightningModule (no single submodule owns every parameter outside the blocks).
- SCALED_EMBEDDING: an ``nn.Embedding`` subclass whose forward multiplies by sqrt(hidden).
- FUSED_GATE_UP: the MLP's ``gate_up_proj`` output is ``[gate | up]`` (``chunk(2, -1)``).
- INTERLEAVED_QKV: GPT-NeoX's fused ``query_key_value``, laid out ``[q_h | k_h | v_h]`` per head.
- MODULE_DICT: the blocks live in an ``nn.ModuleDict`` keyed "0", "1", ...
- NESTED: each block is an ``nn.ModuleList([attention, mlp])`` (no forward of its own).
- HF_NEOX: Hugging Face GPT-NeoX (interleaved ``query_key_value``, partial rotary), from a small config.
- HF_PHI3: Hugging Face Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``; reads
  ``self.config.num_attention_heads`` at forward time), from a small config.
"""

from __future__ import annotations

import math
from enum import Enum

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from hf_support import train_one_process
from tests_support import BATCH_SIZE

VOCAB, HIDDEN, HEADS, INTERMEDIATE, LAYERS = 256, 32, 4, 64, 2
HEAD_DIM = HIDDEN // HEADS


class Style(str, Enum):
    PLAIN = "plain"
    SCALED_EMBEDDING = "scaled_embedding"
    FUSED_GATE_UP = "fused_gate_up"
    INTERLEAVED_QKV = "interleaved_qkv"
    MODULE_DICT = "module_dict"
    NESTED = "nested"
    HF_NEOX = "hf_neox"
    HF_PHI3 = "hf_phi3"


class ScaledEmbedding(nn.Embedding):
    """Gemma-style: the lookup times sqrt(hidden)."""

    def forward(self, ids):
        return super().forward(ids) * math.sqrt(self.embedding_dim)


class Attention(nn.Module):
    """Separate q/k/v; the head count is read from the projection width at run time."""

    def __init__(self, declare_heads: bool):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        if declare_heads:
            self.num_heads = HEADS

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class InterleavedAttention(nn.Module):
    """GPT-NeoX's layout: the fused output, viewed [b, s, heads, 3*head_dim], splits into q|k|v per head."""

    def __init__(self):
        super().__init__()
        self.num_attention_heads = HEADS
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, -1, 3 * HEAD_DIM).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class FusedGateUpMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, style: Style):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        interleaved = style is Style.INTERLEAVED_QKV
        # PLAIN keeps no head count anywhere; the others declare it as models usually do.
        self.attn = InterleavedAttention() if interleaved else Attention(declare_heads=style is not Style.PLAIN)
        self.mlp = FusedGateUpMLP() if style is Style.FUSED_GATE_UP else MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HandLM(L.LightningModule):
    """Embedding, blocks, final norm and head straight on the LightningModule."""

    def __init__(self, style: str = "plain"):
        super().__init__()
        self.style = Style(style)
        if self.style is Style.HF_NEOX:
            import transformers as tf

            config = tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
                                      max_position_embeddings=64, rotary_pct=0.5, tie_word_embeddings=False,
                                      hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
            self.model = tf.GPTNeoXForCausalLM(config)
            self.losses = []
            return
        if self.style is Style.HF_PHI3:
            import transformers as tf

            config = tf.Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                   intermediate_size=INTERMEDIATE, max_position_embeddings=64, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)  # fmt: skip
            self.model = tf.Phi3ForCausalLM(config)
            self.losses = []
            return
        embedding = ScaledEmbedding if self.style is Style.SCALED_EMBEDDING else nn.Embedding
        self.embed = embedding(VOCAB, HIDDEN)
        if self.style is Style.MODULE_DICT:
            self.layers = nn.ModuleDict({str(i): Block(self.style) for i in range(LAYERS)})
        elif self.style is Style.NESTED:
            self.layers = nn.ModuleList(nn.ModuleList([Attention(True), MLP()]) for _ in range(LAYERS))
        else:
            self.layers = nn.ModuleList(Block(self.style) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.losses = []

    def forward(self, ids):
        if self.style in (Style.HF_NEOX, Style.HF_PHI3):
            return self.model(input_ids=ids).logits
        x = self.embed(ids)
        if self.style is Style.NESTED:
            for attn, mlp in self.layers:
                x = x + attn(x)
                x = x + mlp(x)
        else:
            for block in self.layers.values() if self.style is Style.MODULE_DICT else self.layers:
                x = block(x)
        return self.lm_head(self.norm(x))

    def compute_loss(self, batch):
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


def hand_reference_run(style: str, steps: int, data_ranks: int, batch_size: int = BATCH_SIZE) -> list[float]:
    """One process, same init and the same global batches as a multi-process run with ``data_ranks``."""
    L.seed_everything(0, verbose=False)
    module = HandLM(style)
    return train_one_process(module, steps, data_ranks, batch_size)
