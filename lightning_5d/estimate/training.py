"""One training run as the planner sees it: layout sizes, modes, batch shape; and whether it is buildable.

Symbols: t = tp, p = pp, v = virtual stages per pp rank, m = pipeline microbatches,
b = micro-batch size, s = sequence length, N_d = ranks a ZeRO stage shards over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lightning_5d.config import (
    DEFAULT_RANK_ORDER,
    ActivationCheckpointing,
    ContextParallelMode,
    Layout,
    LayoutError,
    PipelineSchedule,
    ZeroStage,
    _coerce_enum,
)

from .spec import ModelSpec


class Precision(str, Enum):
    """Bytes a run keeps per parameter and per activation element (see memory.STATE_BYTES)."""

    BF16 = "bf16"  # bf16 params/grads/activations, fp32 master weights + Adam moments
    FP32 = "fp32"  # everything fp32, Adam moments only (no separate master copy)
    FP8 = "fp8"  # bf16 mixed precision whose matmuls run in fp8 (weights stay bf16; casts are transient)


class StateAccounting(str, Enum):
    """Which bytes of mixed-precision model state are counted (fp32 runs hold the same in both)."""

    # ZeRO paper / playbook: bf16 gradients only; the fp32 gradient the master steps with is not counted.
    PAPER = "paper"
    # What FiveDStrategy holds at the optimizer step: the fp32 master gradient (full at ZeRO-0, where
    # the bf16 one is freed as it moves; a 1/N slice at ZeRO-1/2), and at ZeRO-3 FSDP2's fp32 shards
    # as parameters with fp32 sharded gradients.
    RUNTIME = "runtime"


# Lightning's precision strings, so `precision=trainer.precision` works.
_PRECISION_ALIASES = {
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "bf16",
    "32": "fp32",
    "32-true": "fp32",
    "transformer-engine": "fp8",
}


class AttentionKernel(str, Enum):
    """Whether the s x s score matrix is stored for backward (eager) or recomputed in-kernel (flash/SDPA)."""

    FLASH = "flash"
    EAGER = "eager"


# Schedules whose stages are split into two chunks laid out as a "V" (v is fixed at 2).
V_SHAPED = frozenset({PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV})


@dataclass(frozen=True)
class TrainingSetup:
    """Layout sizes plus every mode that changes memory, FLOPs or communication."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    cp_mode: ContextParallelMode = ContextParallelMode.RING  # how attention crosses the cp ranks
    cp_ulysses: int | None = None  # cp_mode=hybrid: cp ranks per all-to-all group (the ring runs over cp/cp_ulysses)
    pp: int = 1
    ep: int = 1
    zero: ZeroStage = ZeroStage.OPTIMIZER  # ParallelConfig's default; irrelevant without data parallelism
    sequence_parallel: bool = True  # only meaningful with tp > 1; on by default as in Megatron/torchtitan
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    microbatches: int | None = None  # m per pipeline run; None: 2*pp (config.PipelineConfig's default), 1 without pp
    virtual_stages: int = 1  # v; V-shaped schedules always use 2
    recompute: ActivationCheckpointing = ActivationCheckpointing.NONE
    precision: Precision = Precision.BF16
    fp32_grad_accumulation: bool = False
    state_accounting: StateAccounting = StateAccounting.RUNTIME
    micro_batch_size: int = 1  # b, sequences per microbatch per data-parallel rank
    seq_len: int = 4096  # s, full sequence (cp splits it)
    grad_accum: int = 1  # optimizer step = grad_accum pipeline runs of m microbatches each
    attention: AttentionKernel = AttentionKernel.FLASH
    rank_order: tuple[str, ...] = DEFAULT_RANK_ORDER

    def __post_init__(self) -> None:
        coerce = {
            "zero": ZeroStage,
            "schedule": PipelineSchedule,
            "recompute": ActivationCheckpointing,
            "attention": AttentionKernel,
            "cp_mode": ContextParallelMode,
            "state_accounting": StateAccounting,
        }
        for name, enum_cls in coerce.items():
            object.__setattr__(self, name, _coerce_enum(enum_cls, getattr(self, name), name))
        precision = getattr(self.precision, "value", self.precision)
        precision = _PRECISION_ALIASES.get(str(precision), precision)
        object.__setattr__(self, "precision", _coerce_enum(Precision, precision, "precision"))
        for name in (
            "dp_replicate",
            "dp_shard",
            "tp",
            "cp",
            "pp",
            "ep",
            "micro_batch_size",
            "seq_len",
            "grad_accum",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r} must be an integer >= 1.")
        if self.microbatches is not None and self.microbatches < 1:
            raise LayoutError(f"microbatches={self.microbatches} must be >= 1.")
        if self.virtual_stages < 1:
            raise LayoutError(f"virtual_stages={self.virtual_stages} must be >= 1.")
        object.__setattr__(self, "rank_order", tuple(self.rank_order))

    # --- derived sizes ---------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return Layout(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            rank_order=self.rank_order,
        )

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs tp > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def m(self) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return 2 * self.pp if self.pp > 1 else 1

    @property
    def v(self) -> int:
        if self.schedule in V_SHAPED:
            return 2
        return self.virtual_stages if self.schedule == PipelineSchedule.INTERLEAVED_1F1B else 1

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches each data-parallel replica runs per optimizer step (m * grad_accum)."""
        return self.m * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: b * m * grad_accum * dp (cp splits sequences, it adds none)."""
        return self.micro_batch_size * self.microbatches_per_step * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def zero_group(self) -> int:
        """N_d: ranks ZeRO shards over (dp_shard x cp, as the FSDP mesh `dp_shard_cp`)."""
        return self.dp_shard * self.cp

    @property
    def grad_reduce_group(self) -> int:
        """Ranks whose gradients are averaged: every data rank and every cp rank."""
        return self.dp_replicate * self.dp_shard * self.cp

    def replace(self, **changes: Any) -> TrainingSetup:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts = [f"dp_rep={self.dp_replicate} dp_shard={self.dp_shard}"]  # HSDP
        else:
            parts = [f"dp={self.dp}"]
        parts += [f"{d}={getattr(self, d)}" for d in ("tp", "cp", "pp", "ep") if getattr(self, d) > 1]
        if self.cp > 1:
            parts.append(self.cp_mode_text)
        parts.append(f"zero={int(self.zero)}")
        if self.pp > 1:
            sched = self.schedule.value + (f"(v={self.v})" if self.v > 1 else "")
            parts.append(f"{sched} m={self.m}")
        if self.sp:
            parts.append("sp")
        parts.append(f"mbs={self.micro_batch_size}")
        if self.grad_accum > 1:
            parts.append(f"ga={self.grad_accum}")
        if self.recompute != ActivationCheckpointing.NONE:
            parts.append(f"ac={self.recompute.value}")
        return " ".join(parts)

    @property
    def cp_mode_text(self) -> str:
        """``ring``, ``allgather``, ``alltoall`` or ``hybrid(a2a=U,ring=R)``."""
        if self.cp_mode is ContextParallelMode.HYBRID and self.cp_ulysses:
            return f"hybrid(a2a={self.cp_ulysses},ring={self.cp // self.cp_ulysses})"
        return self.cp_mode.value

    def as_dict(self) -> dict[str, Any]:
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "cp": self.cp,
            "cp_mode": self.cp_mode.value,
            "cp_ulysses": self.cp_ulysses,
            "pp": self.pp,
            "ep": self.ep,
            "zero": int(self.zero),
            "sequence_parallel": self.sp,
            "schedule": self.schedule.value,
            "microbatches": self.m,
            "virtual_stages": self.v,
            "recompute": self.recompute.value,
            "precision": self.precision.value,
            "fp32_grad_accumulation": self.fp32_grad_accumulation,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "grad_accum": self.grad_accum,
            "attention": self.attention.value,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp(spec: ModelSpec) -> list[int]:
    """t must divide the query heads, the kv heads, the MLP width and the vocabulary, as the
    runtime's ``validate_tensor_parallel`` demands (it gives each rank whole kv heads and a
    vocabulary shard; it never replicates kv heads)."""
    return [
        t
        for t in _divisors(spec.num_heads)
        if spec.kv_heads % t == 0 and spec.intermediate_size % t == 0 and spec.vocab_size % t == 0
    ]


def valid_pp(spec: ModelSpec, v: int = 1) -> list[int]:
    return [p for p in _divisors(spec.num_layers) if spec.num_layers % (p * v) == 0]


def valid_cp(seq_len: int, limit: int = 64) -> list[int]:
    """Zig-zag splits the sequence into 2*cp chunks; cp=1 needs no split."""
    return [c for c in range(1, limit + 1) if c == 1 or seq_len % (2 * c) == 0]


def validate(spec: ModelSpec, setup: TrainingSetup, gpus: int | None = None) -> None:
    """Raise ``LayoutError`` naming the first value that cannot be built, and what would work."""
    if gpus is not None and setup.world_size != gpus:
        raise LayoutError(
            f"dp*tp*pp*cp = {setup.world_size} != gpus {gpus} (dp={setup.dp}, tp={setup.tp}, pp={setup.pp}, "
            f"cp={setup.cp}); choose sizes whose product is {gpus} (its divisors: {_divisors(gpus)})."
        )
    t = setup.tp
    if spec.num_heads % t:
        raise LayoutError(
            f"tp={t} does not divide num_heads={spec.num_heads} (each rank needs whole heads); "
            f"valid tp: {valid_tp(spec)}."
        )
    if spec.kv_heads % t:
        raise LayoutError(
            f"tp={t} does not divide num_kv_heads={spec.kv_heads} (the runtime gives each tp rank whole kv heads "
            f"and does not replicate them); valid tp: {valid_tp(spec)}."
        )
    if spec.vocab_size % t:
        raise LayoutError(
            f"tp={t} does not divide vocab_size={spec.vocab_size} (the runtime shards the vocabulary over tp); "
            f"valid tp: {valid_tp(spec)}."
        )
    if spec.intermediate_size % t or (spec.is_moe and spec.expert_width % t):
        raise LayoutError(
            f"tp={t} does not divide the MLP width {spec.intermediate_size}"
            f"{f' / expert width {spec.expert_width}' if spec.is_moe else ''}; valid tp: {valid_tp(spec)}."
        )
    if setup.schedule in V_SHAPED and setup.virtual_stages not in (1, 2):
        raise LayoutError(
            f"virtual_stages={setup.virtual_stages} with schedule={setup.schedule.value}: V-shaped schedules "
            f"always place 2 chunks per rank; use virtual_stages=2 (or 1, read as 2)."
        )
    pv = setup.pp * setup.v
    if spec.num_layers % pv:
        raise LayoutError(
            f"pp*v = {setup.pp}*{setup.v} = {pv} does not divide num_layers={spec.num_layers}; "
            f"valid pp for v={setup.v}: {valid_pp(spec, setup.v)}."
        )
    if setup.pp > 1 and setup.schedule == PipelineSchedule.INTERLEAVED_1F1B and setup.m % setup.pp:
        good = [k * setup.pp for k in range(1, 5)]
        raise LayoutError(
            f"microbatches={setup.m} is not a multiple of pp={setup.pp}, which interleaved 1F1B needs; try {good}."
        )
    if setup.cp > 1 and setup.seq_len % (2 * setup.cp):
        raise LayoutError(
            f"seq_len={setup.seq_len} is not divisible by 2*cp = {2 * setup.cp} (zig-zag gives each cp rank two "
            f"chunks); valid cp: {valid_cp(setup.seq_len, limit=max(8, setup.cp))}."
        )
    if setup.ep > 1:
        if not spec.is_moe:
            raise LayoutError(f"ep={setup.ep} needs an MoE model; {spec.name} has no experts, use ep=1.")
        if spec.num_experts % setup.ep:
            raise LayoutError(
                f"ep={setup.ep} does not divide num_experts={spec.num_experts}; valid ep: "
                f"{[e for e in _divisors(spec.num_experts) if setup.zero_group % e == 0]}."
            )
        if setup.zero_group % setup.ep:
            raise LayoutError(
                f"ep={setup.ep} must divide dp_shard*cp = {setup.zero_group} (expert parallelism borrows those "
                f"ranks); valid ep: {[e for e in _divisors(setup.zero_group) if spec.num_experts % e == 0]}."
            )
