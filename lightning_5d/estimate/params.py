"""Parameter counts (Psi): whole model, active per token, and the model-parallel shard one rank holds.

Per layer, with h hidden, a*d query width, g*d kv width (GQA: g kv heads), f MLP width:
attention ``h*a*d + 2*h*g*d + a*d*h``; SwiGLU MLP ``3*h*f`` (GeLU ``2*h*f``); MoE replaces the
MLP by E experts of width f_e, a router ``h*E`` and optional shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .spec import MlpKind, ModelSpec, NormKind
from .training import TrainingSetup


class Stage(str, Enum):
    """Which pipeline stage a per-rank number describes (they coincide without pp)."""

    FIRST = "first"  # embedding + the first L/p layers; holds the most in-flight microbatches
    LAST = "last"  # the last L/p layers + final norm + output head + loss


@dataclass(frozen=True)
class LayerParams:
    attention: int  # q, k, v, o (+ biases); tensor-parallel
    mlp: int  # dense MLP, or the shared experts of an MoE layer; tensor-parallel
    experts: int  # all routed experts; expert- and tensor-parallel
    active_experts: int  # the k routed experts one token passes through
    router: int  # replicated (tiny)
    norms: int  # replicated (tiny)

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.experts + self.router + self.norms


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # V*h (+ learned position table)
    head: int  # V*h when untied, 0 when tied (shares the embedding)
    final_norm: int
    layer: LayerParams
    num_layers: int
    vocab_hidden: int  # V*h: the output projection's matmul size, tied or not

    @property
    def total(self) -> int:
        """Psi: every distinct parameter."""
        return self.embedding + self.head + self.final_norm + self.num_layers * self.layer.total

    @property
    def active(self) -> int:
        """Parameters one token touches (equals ``total`` for a dense model)."""
        inactive = self.layer.experts - self.layer.active_experts
        return self.total - self.num_layers * inactive

    @property
    def matmul_active(self) -> int:
        """Matmul weights one token multiplies with: what the 6N of the FLOPs rule counts.

        Excludes the embedding lookup and norms (no matmul), includes the output head even when
        tied (its V*h matmul still runs).
        """
        layer = self.layer
        per_layer = layer.attention + layer.mlp + layer.active_experts + layer.router
        return self.num_layers * per_layer + self.vocab_hidden


def _mlp_params(spec: ModelSpec, width: int) -> int:
    h = spec.hidden_size
    if spec.mlp == MlpKind.SWIGLU:
        return 3 * h * width + (2 * width + h if spec.bias else 0)
    return 2 * h * width + (width + h if spec.bias else 0)


def count_params(spec: ModelSpec) -> ParamCounts:
    h = spec.hidden_size
    norm = h * (2 if spec.norm == NormKind.LAYERNORM else 1)
    attention = 2 * h * spec.q_width + 2 * h * spec.kv_width
    if spec.bias:
        attention += spec.q_width + 2 * spec.kv_width + h
    if spec.is_moe:
        one_expert = _mlp_params(spec, spec.expert_width)
        layer = LayerParams(
            attention=attention,
            mlp=_mlp_params(spec, spec.shared_width) if spec.shared_width else 0,
            experts=spec.num_experts * one_expert,
            active_experts=spec.experts_top_k * one_expert,
            router=h * spec.num_experts,
            norms=2 * norm,
        )
    else:
        layer = LayerParams(
            attention=attention,
            mlp=_mlp_params(spec, spec.intermediate_size),
            experts=0,
            active_experts=0,
            router=0,
            norms=2 * norm,
        )
    vh = spec.vocab_size * h
    embedding = vh + (spec.max_seq_len * h if spec.learned_positions else 0)
    return ParamCounts(
        embedding=embedding,
        head=0 if spec.tie_embeddings else vh + (spec.vocab_size if spec.bias else 0),
        final_norm=norm,
        layer=layer,
        num_layers=spec.num_layers,
        vocab_hidden=vh,
    )


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """g/t kv heads per rank, or 1 replicated head when t exceeds g."""
    return max(spec.kv_heads // tp, 1)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds after TP/PP/EP splitting, before any ZeRO sharding."""

    dense: int  # sharded by ZeRO over N_d = dp_shard*cp
    expert: int  # sharded by ZeRO over N_d/ep (the ep group borrows from dp_shard*cp)
    layers: int  # transformer layers on this rank (L/p)
    layer_dense: int  # one layer's dense part on this rank (ZeRO-3 gathers one layer at a time)
    layer_expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_params(
    spec: ModelSpec, setup: TrainingSetup, stage: Stage, counts: ParamCounts | None = None
) -> RankParams:
    """Psi on one rank of ``stage``: L/p layers split t ways (experts ep*t ways) plus embedding/head.

    Convention: expert weights are tensor-parallel too (expert-TP = TP, Megatron's default).
    Tied embeddings under pp > 1 keep a copy on the last stage, as Megatron does.
    """
    c = counts or count_params(spec)
    t, p = setup.tp, setup.pp
    layer = c.layer
    # K/V weights are replicated, not split, once t exceeds the kv heads.
    kv_part = 2 * spec.hidden_size * spec.d_head * kv_heads_per_rank(spec, t)
    attention = (layer.attention - 2 * spec.hidden_size * spec.kv_width) // t + kv_part
    layer_dense = attention + layer.mlp // t + layer.router + layer.norms
    layer_expert = layer.experts // (setup.ep * t)
    layers = spec.num_layers // p
    dense = layers * layer_dense
    first, last = stage == Stage.FIRST or p == 1, stage == Stage.LAST or p == 1
    if first:
        dense += c.embedding // t
    if last:
        dense += c.final_norm + c.head // t
        if spec.tie_embeddings and p > 1:
            dense += c.vocab_hidden // t
    return RankParams(
        dense=dense,
        expert=layers * layer_expert,
        layers=layers,
        layer_dense=layer_dense,
        layer_expert=layer_expert,
    )
