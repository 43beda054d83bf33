"""Per-rank memory: model states (params, grads, optimizer) under ZeRO, activations, buffers.

Model states follow the ZeRO paper with k = optimizer bytes per parameter (k = 12 for Adam
with an fp32 master copy): Z0 ``(2+2+k)Psi``, Z1 ``2Psi + 2Psi + k*Psi/N_d``,
Z2 ``2Psi + (2+k)Psi/N_d``, Z3 ``(2+2+k)Psi/N_d``; fp32 gradient accumulation adds a 4-byte
gradient copy (sharded from Z2 on).

Activations follow Korthikanti et al. 2022 (KOR) Table 2, term by term, so the same code gives
the paper's ``sbh(34 + 5as/h)`` for a GPT-shaped model (GeLU 4h MLP, dropout, scores kept)
and shape-aware numbers for Llama-style models (GQA kv width, SwiGLU width, MoE top-k, no
dropout, flash attention keeps no s x s scores). TP splits the tensors inside the attention and
MLP; the rest (norm inputs, matmul inputs, dropout masks) only with SP. Selective recompute
drops the s x s score terms; full recompute keeps only each layer's input (2sbh).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_5d.accounting import ModelStateBytes
from lightning_5d.config import ActivationCheckpointing, ContextParallelMode, ZeroStage

from .params import ParamCounts, RankParams, Stage, count_params, kv_heads_per_rank, rank_params
from .schedule import in_flight_layer_microbatches, last_stage_in_flight
from .spec import MlpKind, ModelSpec, NormKind
from .training import AttentionKernel, Precision, StateAccounting, TrainingSetup

GIB = 2**30

# (param, grad, optimizer) bytes per parameter. bf16 mixed: bf16 weights and grads, fp32 master
# + Adam m + v (k = 12). fp32: weights and grads fp32, Adam m + v (k = 8, no separate master).
# fp8 (torchao/TE): weights stay bf16 with an fp32 master; fp8 copies are per-layer transients.
STATE_BYTES: dict[Precision, tuple[int, int, int]] = {
    Precision.BF16: (2, 2, 12),
    Precision.FP32: (4, 4, 8),
    Precision.FP8: (2, 2, 12),
}
ACTIVATION_BYTES: dict[Precision, int] = {Precision.BF16: 2, Precision.FP32: 4, Precision.FP8: 2}

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket; two in flight (one reducing, one filling)


def bytes_per_param(precision: Precision, fp32_grad_accumulation: bool = False) -> tuple[int, int, int]:
    param, grad, optimizer = STATE_BYTES[Precision(precision)]
    if fp32_grad_accumulation and grad < 4:
        grad += 4  # a separate fp32 accumulator next to the bf16 gradients
    return param, grad, optimizer


def model_state_bytes(
    psi: float,
    zero: ZeroStage | int = ZeroStage.NONE,
    nd: int = 1,
    precision: Precision | str = Precision.BF16,
    fp32_grad_accumulation: bool = False,
    accounting: StateAccounting = StateAccounting.PAPER,
) -> ModelStateBytes:
    """Bytes for Psi parameters on one of N_d ranks sharding at ZeRO stage ``zero``."""
    zero = ZeroStage(zero)
    param, grad, optimizer = bytes_per_param(Precision(precision), fp32_grad_accumulation)
    if StateAccounting(accounting) is StateAccounting.RUNTIME and param < 4:
        return _runtime_mixed_state(psi, zero, nd, fp32_grad_accumulation)
    return ModelStateBytes(
        params=psi * param / (nd if zero >= ZeroStage.PARAMETERS else 1),
        grads=psi * grad / (nd if zero >= ZeroStage.GRADIENTS else 1),
        optimizer=psi * optimizer / (nd if zero >= ZeroStage.OPTIMIZER else 1),
    )


def _runtime_mixed_state(psi: float, zero: ZeroStage, nd: int, fp32_accumulation: bool) -> ModelStateBytes:
    """bf16 weights with fp32 masters as FiveDStrategy holds them at the optimizer step (bytes/param):
    Z0 2 + 4 (fp32 master gradients; the bf16 ones are freed as they move) + 12; Z1 2 + (2 + 4/N) +
    12/N; Z2 2 + 4/N + 12/N; Z3 (FSDP2, fp32 shards cast to bf16 per all-gather) 4/N + 4/N + 8/N.
    fp32 accumulation keeps no extra buffer: each micro-batch is reduced into the fp32 master
    gradients as it comes (more communication instead), which frees ZeRO-1's full bf16 gradient."""
    if zero is ZeroStage.PARAMETERS:
        return ModelStateBytes(params=4 * psi / nd, grads=4 * psi / nd, optimizer=8 * psi / nd)
    bf16_grads = 2 if zero is ZeroStage.OPTIMIZER and not fp32_accumulation else 0
    grads = {ZeroStage.NONE: 4.0, ZeroStage.OPTIMIZER: bf16_grads + 4 / nd, ZeroStage.GRADIENTS: 4 / nd}[zero]
    optimizer = 12 / (nd if zero >= ZeroStage.OPTIMIZER else 1)
    return ModelStateBytes(params=2 * psi, grads=psi * grads, optimizer=psi * optimizer)


def rank_model_state_bytes(spec: ModelSpec, setup: TrainingSetup, rank: RankParams) -> ModelStateBytes:
    """Dense weights shard over N_d = dp_shard*cp; expert weights over N_d/ep (ep borrows those ranks)."""
    kw = dict(
        zero=setup.zero,
        precision=setup.precision,
        fp32_grad_accumulation=setup.fp32_grad_accumulation,
        accounting=setup.state_accounting,
    )
    dense = model_state_bytes(rank.dense, nd=setup.zero_group, **kw)
    experts = model_state_bytes(rank.expert, nd=setup.zero_group // setup.ep, **kw)
    return dense + experts


# --- activations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer keeps for backward, for one microbatch, on one rank, split by how they shard."""

    replicated: float  # outside the matmuls: split by t only with SP
    sharded: float  # inside attention/MLP: always split by t
    scores: float  # the s x s attention scores: split by t, dropped by selective recompute
    layer_input: float  # what full recompute keeps: the layer input

    def stored(self, recompute: ActivationCheckpointing) -> float:
        if recompute == ActivationCheckpointing.FULL:
            return self.layer_input
        if recompute == ActivationCheckpointing.SELECTIVE:
            return self.replicated + self.sharded
        return self.replicated + self.sharded + self.scores

    def recompute_peak(self, recompute: ActivationCheckpointing) -> float:
        """Extra bytes live while one layer is recomputed during backward."""
        return self.stored(ActivationCheckpointing.NONE) - self.stored(recompute)


def norm_extra(spec: ModelSpec, tensor_bytes: float) -> float:
    """Bytes a norm keeps beyond its input.

    KOR's LayerNorm is one fused kernel that keeps only its input. An RMSNorm written in
    PyTorch ops (Hugging Face Llama's, the reference model's) also keeps the normalized
    tensor for the weight's gradient: one more tensor of the input's size.
    """
    return tensor_bytes if spec.norm == NormKind.RMSNORM else 0.0


def layer_activations(spec: ModelSpec, setup: TrainingSetup) -> LayerActivations:
    """KOR's per-layer terms on one rank: s = seq/cp local tokens, b micro-batch, e bytes per element."""
    e = ACTIVATION_BYTES[setup.precision]
    s, b, h, t = setup.seq_len / setup.cp, setup.micro_batch_size, spec.hidden_size, setup.tp
    sb = s * b
    rep = t if setup.sp else 1
    # Two norm inputs, the attention input and the MLP input (KOR: 4sbh + 2sbh + 2sbh).
    replicated = 4 * e * sb * h
    replicated += 2 * norm_extra(spec, e * sb * h)
    if spec.dropout:
        replicated += 2 * sb * h  # one-byte masks after attention and after the MLP (KOR: 2sbh)
    kv = 2 * e * sb * spec.d_head * kv_heads_per_rank(spec, t)  # K and V (replicated heads when t > g)
    sharded = 2 * e * sb * spec.q_width / t + kv  # Q and the attention output (o-proj input)
    a_rank = spec.num_heads / t
    if setup.attention == AttentionKernel.EAGER:
        scores = e * a_rank * s * s * b  # softmax output
        if spec.dropout:  # a one-byte mask and the dropout output (KOR: 5as^2b in all)
            scores += a_rank * s * s * b + e * a_rank * s * s * b
    else:
        scores = 0.0
        sharded += 4 * a_rank * sb  # flash keeps only the fp32 log-sum-exp per row
    tensors_per_width = 4 if spec.mlp == MlpKind.SWIGLU else 2  # SwiGLU: gate, up, act(gate), product
    if spec.is_moe:
        k = spec.experts_top_k
        replicated += 2 * 4 * sb * spec.num_experts  # router logits and probabilities, fp32
        replicated += 2 * e * sb * k * h  # tokens dispatched to their k experts, and the experts' outputs
        sharded += tensors_per_width * e * sb * (k * spec.expert_width + spec.shared_width) / t
    else:
        sharded += tensors_per_width * e * sb * spec.intermediate_size / t
    return LayerActivations(replicated=replicated / rep, sharded=sharded, scores=scores, layer_input=e * sb * h / rep)


def head_activations(spec: ModelSpec, setup: TrainingSetup) -> float:
    """Last stage, one microbatch: final-norm input, head input, fp32 logits for the loss (KOR's 4sbV/t)."""
    e = ACTIVATION_BYTES[setup.precision]
    sb = setup.seq_len / setup.cp * setup.micro_batch_size
    rep = setup.tp if setup.sp else 1
    norm = 2 * e * sb * spec.hidden_size + norm_extra(spec, e * sb * spec.hidden_size)
    return norm / rep + 4 * sb * spec.vocab_size / setup.tp


@dataclass(frozen=True)
class StageActivations:
    layers: float  # stored layer activations x microbatches in flight
    head: float
    recompute_peak: float

    @property
    def total(self) -> float:
        return self.layers + self.head + self.recompute_peak


def stage_activations(spec: ModelSpec, setup: TrainingSetup, stage: Stage) -> StageActivations:
    layer = layer_activations(spec, setup)
    stored = layer.stored(setup.recompute)
    peak = layer.recompute_peak(setup.recompute)
    if setup.pp == 1 or stage == Stage.FIRST:
        layers = stored * in_flight_layer_microbatches(setup, spec.num_layers)
        head = head_activations(spec, setup) if setup.pp == 1 else 0.0
    else:
        held = last_stage_in_flight(setup)
        layers = stored * spec.num_layers / setup.pp * held
        head = head_activations(spec, setup) * held
    return StageActivations(layers=layers, head=head, recompute_peak=peak)


def activation_memory(spec: ModelSpec, setup: TrainingSetup) -> float:
    """KOR-style activation bytes of all L layers for one microbatch (no pp, no head): the Table 2 number x L."""
    return layer_activations(spec, setup).stored(setup.recompute) * spec.num_layers


# --- buffers -------------------------------------------------------------------------------


def buffer_bytes(spec: ModelSpec, setup: TrainingSetup, rank: RankParams) -> dict[str, float]:
    """Transient buffers that exist on top of states and activations, by cause."""
    param_b, grad_b, _ = bytes_per_param(setup.precision, setup.fp32_grad_accumulation)
    layer = rank.layer_dense + rank.layer_expert
    out: dict[str, float] = {}
    if setup.zero >= ZeroStage.PARAMETERS and setup.zero_group > 1 and setup.pp > 1:
        # Under a pipeline schedule the units reduce once per run (parallel/pipeline/fsdp.py):
        # until then the rank's full gradients wait unreduced (fp32, FSDP's reduce dtype) and,
        # by the last backward, every layer of the rank is gathered.
        out["zero3_pipeline_held"] = rank.total * (param_b + 4)
    elif setup.zero >= ZeroStage.PARAMETERS and setup.zero_group > 1:
        # FSDP keeps the gathered weights of the running layer and the prefetched next one,
        # plus one layer's full gradients before its reduce-scatter.
        out["zero3_gather"] = 2 * layer * param_b + layer * grad_b
        # ...and the unit holding the head, which is not resharded after forward (it runs last in
        # forward, first in backward; parallel/data/fsdp.py), from its forward to its backward.
        out["zero3_head_unit"] = zero3_head_unit(spec, setup.tp) * param_b
    elif setup.grad_reduce_group > 1:
        out["grad_buckets"] = 2 * DEFAULT_BUCKET_BYTES
    if setup.precision == Precision.FP8:
        out["fp8_weight_casts"] = layer * 1.0  # one layer's fp8 weight copies
    if setup.cp > 1:
        e = ACTIVATION_BYTES[setup.precision]
        chunk = (
            2 * e * setup.seq_len / setup.cp * setup.micro_batch_size * spec.d_head * kv_heads_per_rank(spec, setup.tp)
        )
        out.update(_context_parallel_transient(spec, setup, chunk))
    return out


def zero3_head_unit(spec: ModelSpec, tp: int = 1, counts: ParamCounts | None = None) -> int:
    """Parameters of the ZeRO-3 unit that stays gathered through a step (one rank, after tp).

    Untied: final norm + head (the embedding is a unit of its own, resharded after its forward).
    Tied: the embedding, which the head shares, stays in the root unit with the final norm; FSDP2
    does not reshard the root after forward, so the shared V*h is held for the whole step.
    """
    c = counts or count_params(spec)
    if spec.tie_embeddings:
        return c.embedding // tp + c.final_norm
    return c.final_norm + c.head // tp


def _context_parallel_transient(spec: ModelSpec, setup: TrainingSetup, kv_block: float) -> dict[str, float]:
    """Attention's extra live buffers under cp, by ``setup.cp_mode`` (the fused block kernels
    need only tiles; what differs is what each mode holds of the other ranks' K/V).

    Forward buffers, in activation precision: ring, the K/V block in use and the one
    arriving; allgather, the whole gathered K/V (cp blocks); alltoall, the head-shard copies
    of q, k, v and the output (as many bytes as the local tensors) plus their copies
    reordered to sequence order; hybrid, the alltoall's head shards plus the ring's two K/V
    blocks of the head shard (h_kv/U heads of U·s positions: the local block's bytes).
    """
    cp, e = setup.cp, ACTIVATION_BYTES[setup.precision]
    if setup.cp_mode is ContextParallelMode.ALL_GATHER:
        return {"cp_gathered_kv": cp * kv_block}
    q = e * setup.seq_len / cp * setup.micro_batch_size * spec.d_head * spec.num_heads / setup.tp
    if setup.cp_mode is ContextParallelMode.ALL_TO_ALL:
        return {"cp_head_shards": 2 * (2 * q + kv_block)}
    if setup.cp_mode is ContextParallelMode.HYBRID:
        return {"cp_head_shards": 2 * (2 * q + kv_block), "cp_ring": 2 * kv_block}
    return {"cp_ring": 2 * kv_block}


# --- the whole rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    stage: Stage
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def gib(self) -> dict[str, float]:
        keys = ("params", "grads", "optimizer", "activations", "buffers")
        out = {k: getattr(self, k) / GIB for k in keys}
        out["total"] = self.total / GIB
        return out


def stage_memory(
    spec: ModelSpec, setup: TrainingSetup, stage: Stage, counts: ParamCounts | None = None
) -> MemoryBreakdown:
    rank = rank_params(spec, setup, stage, counts)
    states = rank_model_state_bytes(spec, setup, rank)
    acts = stage_activations(spec, setup, stage)
    buffers = buffer_bytes(spec, setup, rank)
    detail = {
        "activations_layers": acts.layers,
        "activations_head": acts.head,
        "activations_recompute_peak": acts.recompute_peak,
        **{f"buffer_{k}": v for k, v in buffers.items()},
    }
    return MemoryBreakdown(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts.total,
        buffers=sum(buffers.values()),
        stage=stage,
        detail=detail,
    )


def rank_memory(spec: ModelSpec, setup: TrainingSetup, counts: ParamCounts | None = None) -> MemoryBreakdown:
    """The most loaded rank: the first stage (most microbatches in flight) or the last (head, logits)."""
    counts = counts or count_params(spec)
    if setup.pp == 1:
        return stage_memory(spec, setup, Stage.FIRST, counts)
    return max((stage_memory(spec, setup, s, counts) for s in Stage), key=lambda mb: mb.total)
