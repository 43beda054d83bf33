"""A small Llama-style decoder and its LightningModule.

This is deliberately an *ordinary* user model: plain ``nn.Module``s, no knowledge of
any parallelism. Everything the 5D strategy does to it (TP, CP, PP, EP, ZeRO, FP8) must
work from the outside, so this file must never import from ``lightning_5d`` or grow
hooks for it. Architecture: pre-norm blocks, RMSNorm, RoPE (rotate-half convention, as
in Hugging Face Llama), grouped-query attention, SwiGLU MLP or a token-choice top-k MoE.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    num_experts: int = 0  # 0: dense SwiGLU MLP; >0: MoE feed-forward
    experts_top_k: int = 2
    moe_intermediate_size: int | None = None  # None -> intermediate_size
    num_shared_experts: int = 0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim={self.hidden_size // self.num_heads} must be even for RoPE")
        if self.num_experts and not 0 < self.experts_top_k <= self.num_experts:
            raise ValueError(f"experts_top_k={self.experts_top_k} must be in [1, num_experts={self.num_experts}]")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: the mean of squares loses too much precision in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [b, s, 1, head_dim] (fp32) for the given absolute positions.

    Computed from ``position_ids`` on every call instead of a precomputed buffer: a
    sequence shard (context parallel) just passes its true positions, and there is no
    buffer to lose when a model is built on the meta device and materialized later.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [b, s, 1, head_dim]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, head_dim]; done in fp32 so bf16 keeps positions exact."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the tensors (-1), not from self.num_heads: if the
        # projections are resized (e.g. column-sharded), the module still works.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)

        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        n_rep = q.size(1) // k.size(1)
        if n_rep > 1:
            # GQA: query head i reads kv head i // n_rep.
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts, plus optional always-on shared experts."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.experts_top_k
        inter = config.expert_intermediate_size
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(config.hidden_size, inter) for _ in range(config.num_experts))
        self.shared_experts = (
            SwiGLUMLP(config.hidden_size, config.num_shared_experts * inter) if config.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [tokens, hidden]
        # Softmax/top-k on fp32 logits: near-ties between experts would flip under bf16
        # rounding. The router itself is called as a module (in the ambient dtype) so
        # that wrappers and mixed-precision policies still see it, as in torchtitan.
        probs = self.router(x).float().softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(top_i == e)
            # No "skip if empty": an expert run on zero tokens still gets (zero) grads,
            # so no parameter is ever unused and no host sync is needed here.
            y = expert(x[tok]) * top_w[tok, slot].unsqueeze(-1).to(x.dtype)
            out = out.index_add(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        if config.num_experts:
            self.moe = MoEFeedForward(config)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), position_ids)
        ff = self.moe if hasattr(self, "moe") else self.mlp
        return x + ff(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Discard the random draws of torch's default initializers (overwritten below),
        # so the weights depend only on the RNG state on entry: an eager build and a
        # meta-device build followed by init_weights() give identical parameters.
        with torch.random.fork_rng(devices=[]):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one Parameter, two uses
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, init_std) for linears/embedding, ones for norms.

        Visits modules in registration order, so the result depends only on the RNG
        state; it can be re-run after materializing a meta-device model.
        """
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.config.init_std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, position_ids)
        return self.lm_head(self.norm(h))


class LlamaLM(L.LightningModule):
    """Causal LM training around :class:`LlamaModel`.

    Batches are ``{"input_ids": [b, s], "labels": [b, s]}`` with labels already aligned
    (labels[t] is the token after input_ids[t]; -100 is ignored), which is what
    :class:`~lightning_5d.models.data.TextDataModule` yields. A batch without "labels"
    is shifted here as a convenience for single-process use; a sequence-sharding
    strategy cannot do that shift correctly inside a shard, so always send labels.
    """

    def __init__(
        self,
        config: LlamaConfig | dict | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas=(0.9, 0.95),
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        if config is None:
            config = LlamaConfig()
        elif isinstance(config, dict):
            config = LlamaConfig(**config)
        cfg = config
        # save_hyperparameters reads the locals: store the config as a plain dict so
        # checkpoints load with torch.load(weights_only=True) and hparams.yaml is readable.
        config = asdict(cfg)
        self.save_hyperparameters()
        self.model = LlamaModel(cfg)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, position_ids)

    def _loss(self, batch: dict) -> torch.Tensor:
        input_ids = batch["input_ids"]
        labels = batch.get("labels")
        if labels is None:
            input_ids, labels = input_ids[:, :-1], input_ids[:, 1:]
        logits = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        if hp.warmup_steps <= 0:
            return opt
        warmup = hp.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

