"""Layout and parallelism settings, validated before any process group starts.

``ParallelConfig`` is what users write (Python keyword arguments or a Hydra ``parallel:``
group); ``Layout`` is the resolved, immutable set of sizes the mesh is built from. Every
error names the offending value and a value that would work.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Annotated, Any, Literal, Mapping, Union

from datetime import timedelta

import torch
from pydantic import AfterValidator, BeforeValidator, Field
from torch.distributed.constants import default_pg_timeout

from lightning_5d.checkpoint.options import CheckpointFormat, CheckpointWrite

from lightning_5d.schema import Allowed, Bool, EnumField, Float, Int, Optional_, enum_member, settings

AUTO = "auto"
SizeSpec = Union[int, str]  # a data size: an integer or "auto"

# Outermost first. pp outermost keeps stage-to-stage traffic off the fastest links; tp
# innermost keeps its per-layer collectives on them (the playbook's placement rule).
DEFAULT_RANK_ORDER: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MESH_DIMS = frozenset(DEFAULT_RANK_ORDER)

# Every dimension the strategy implements (the planner searches a subset of them).
IMPLEMENTED_DIMS = frozenset({"dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"})


class LayoutError(ValueError):
    """A layout that cannot be built; the message names the value and a fix."""


class ZeroStage(IntEnum):
    """What the data-parallel ranks shard (ZeRO paper, stages 0-3)."""

    NONE = 0  # replicate params, grads, optimizer states; all-reduce grads
    OPTIMIZER = 1  # shard optimizer states
    GRADIENTS = 2  # shard optimizer states and gradients
    PARAMETERS = 3  # shard everything (FSDP2)


class ActivationCheckpointing(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"  # keep matmul/attention outputs, recompute the cheap ops
    FULL = "full"  # keep only each block's input, recompute the block


class PipelineSchedule(str, Enum):
    AFAB = "afab"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


# Schedules that split each backward into input-gradient (B) and weight-gradient (W) work.
SPLIT_BACKWARD = frozenset({PipelineSchedule.ZERO_BUBBLE, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV})


class ContextParallelMode(str, Enum):
    RING = "ring"
    ALL_GATHER = "allgather"
    ALL_TO_ALL = "alltoall"  # Ulysses: sequence shard -> head shard around attention
    HYBRID = "hybrid"  # Ulysses inside groups of `ulysses` cp ranks x ring across the groups (Megatron a2a+p2p)


class SequenceSharding(str, Enum):
    """How the sequence is cut over the cp ranks."""

    ZIGZAG = "zigzag"  # 2*cp chunks, rank r holds r and 2*cp-1-r: equal causal work per rank
    CONTIGUOUS = "contiguous"  # cp chunks in order: rank r does r+1 causal blocks


class VerifyMode(str, Enum):
    """What setup proves about the applied plan before training (``lightning_5d.verify``)."""

    # BLOCKS where tp, cp, pp, expert dispatch or FP8 rewrite how the model computes; nothing under
    # ZeRO alone. There every piece runs its own code on the same gathered weights on both sides
    # (no fault in tests/distributed/scripts/verify_cases.py is one it would catch), while its
    # probe must gather the largest tensor: start-up peak 0.38 of a 0.5 B model per rank over 4
    # ranks with it, 0.26 without (benchmarks/RESULTS.md, startup_memory).
    AUTO = "auto"
    # embedding, each block, final norm + head against the unparallelized pieces: outputs, and the
    # gradients of every piece a dimension changed after one backward of it; ZeRO-3 alone included
    BLOCKS = "blocks"
    OUTPUTS = "outputs"  # the same pieces, outputs only (no backward): cheaper, blind to gradient-only errors
    OFF = "off"  # no check: for a model whose probe forward cannot run, or to save its setup time


class StageBalance(str, Enum):
    """How blocks are spread over the pipeline stages when no boundaries are given."""

    PARAMETERS = "parameters"  # equal block parameters per stage
    COST = "cost"  # equal matmul work: the head's parameters count on the last stage too


def _rank_order_is_a_permutation(order: tuple[str, ...]) -> tuple[str, ...]:
    if sorted(order) != sorted(MESH_DIMS):
        raise ValueError("each mesh dimension must appear exactly once")
    return order


# Every field's type, range and allowed values, in one place (checked by pydantic through
# lightning_5d.schema); cross-field rules that need the world size live in resolve_layout.
PositiveInt = Int(ge=1, allowed="an integer >= 1")
# Only the data dims can absorb the rest of the world ("auto"); model dims change the math.
DataSize = Annotated[
    Union[PositiveInt, Literal["auto"]],  # the integer error first: it is the likelier mistake
    Allowed("an integer >= 1 (1 leaves the dimension off), or 'auto' for the rest of the world"),
]
ModelSize = Int(ge=1, allowed="an integer >= 1 (1 leaves the dimension off)")
RankOrder = Annotated[
    tuple[Literal["pp", "dp_replicate", "dp_shard", "cp", "tp"], ...],
    AfterValidator(_rank_order_is_a_permutation),
    Allowed(f"each of {list(DEFAULT_RANK_ORDER)} exactly once, outermost first"),
]


@settings(LayoutError, "pipeline")
class PipelineConfig:
    schedule: EnumField(PipelineSchedule) = PipelineSchedule.ONE_F_ONE_B
    # None: 2 * pp, enough to keep the 1F1B bubble < 1/3
    microbatches: Optional_(PositiveInt, "an integer >= 1, or None for 2 * pp") = None
    virtual_stages: Int(ge=1, allowed="an integer >= 1 (model chunks per rank)") = 1
    balance: EnumField(StageBalance) = StageBalance.COST
    # Blocks per stage, in stage order (pp * virtual_stages entries); overrides `balance`.
    stage_blocks: Optional_(
        Annotated[list[PositiveInt], Field(min_length=1)],
        "a list of integers >= 1 (blocks per stage, pp * virtual_stages entries), or None",
    ) = None
    log_bubble: Bool() = False  # log the measured idle fraction of each step as `pp_bubble`


@settings(LayoutError, "context")
class ContextConfig:
    mode: EnumField(ContextParallelMode) = ContextParallelMode.RING
    sharding: EnumField(SequenceSharding) = SequenceSharding.ZIGZAG
    # mode="hybrid": cp ranks per all-to-all group (the ring runs over cp/ulysses groups).
    ulysses: Optional_(
        Int(ge=2, allowed="an integer >= 2"), "an integer >= 2 that divides cp (with mode='hybrid'), or None"
    ) = None


class LoadBalancing(str, Enum):
    """How routers are pushed towards even expert load."""

    NONE = "none"  # the model's own routing, untouched: numbers match one process by default
    AUX_LOSS = "aux_loss"  # Switch/GShard auxiliary loss, weighted by aux_loss_coef
    BIAS = "bias"  # DeepSeek-V3's aux-loss-free per-expert selection bias, moved by bias_update_rate


class DropPolicy(str, Enum):
    """Which assignments an over-full expert keeps when a capacity factor is set."""

    PROBABILITY = "probability"  # the highest router weights (GShard, Megatron's "probs")
    POSITION = "position"  # the earliest tokens in the batch (Switch)


@settings(LayoutError, "expert")
class ExpertConfig:
    capacity_factor: Optional_(
        Float(gt=0, allowed="a finite number > 0"), "a finite number > 0 (e.g. 1.25), or None for dropless"
    ) = None
    drop_policy: EnumField(DropPolicy) = DropPolicy.PROBABILITY
    load_balancing: EnumField(LoadBalancing) = LoadBalancing.NONE
    aux_loss_coef: Float(ge=0, allowed="a finite number >= 0") = 0.01  # Switch Transformer's value
    bias_update_rate: Float(ge=0, allowed="a finite number >= 0") = 0.001  # DeepSeek-V3's gamma
    log_load: Bool() = True  # log tokens per expert, load imbalance and dropped tokens (moe/...)

    @property
    def wants_dispatch(self) -> bool:
        """Whether these settings change routing or the loss (then they apply at ep=1 too)."""
        return self.capacity_factor is not None or self.load_balancing != LoadBalancing.NONE


@settings(LayoutError, "parallel")
class ParallelConfig:
    """Everything that decides how a model is split. Sizes may be ``"auto"``."""

    dp_replicate: DataSize = 1
    dp_shard: DataSize = AUTO
    cp: ModelSize = 1
    tp: ModelSize = 1
    pp: ModelSize = 1
    ep: ModelSize = 1
    zero: EnumField(ZeroStage) = ZeroStage.OPTIMIZER
    activation_checkpointing: EnumField(ActivationCheckpointing) = ActivationCheckpointing.NONE
    # Shard norms, dropout and residuals along the sequence between the TP regions.
    sequence_parallel: Bool() = False
    # Module-path patterns -> roles, for models discovery cannot map (see docs/model_plans.md).
    model_plan: Optional_(dict[str, str], "a mapping of module-path patterns to role names, or None") = None
    rank_order: RankOrder = DEFAULT_RANK_ORDER
    # 25 MB matches DDP's default: large enough to amortize launch cost, small enough to overlap.
    bucket_size_mb: Float(gt=0, allowed="a finite number > 0 (default 25)") = 25.0
    # On by default wherever a dimension rewrites the forward: a plan that computes something other
    # than the model would train without an error.
    verify: EnumField(VerifyMode) = VerifyMode.AUTO
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    expert: ExpertConfig = field(default_factory=ExpertConfig)

    def checks_plan(self, rewrites: bool) -> bool:
        """Whether setup runs the plan verifier (``lightning_5d.verify``): wherever a dimension
        rewrites the forward (``rewrites``: tp, cp, pp, expert dispatch or FP8) unless
        ``verify='off'``, and under ZeRO-3 alone only when asked for (``blocks`` / ``outputs``)."""
        asked = self.verify in (VerifyMode.BLOCKS, VerifyMode.OUTPUTS)
        return (rewrites and self.verify != VerifyMode.OFF) or (asked and self.zero == ZeroStage.PARAMETERS)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ParallelConfig":
        if not isinstance(values, Mapping):
            raise LayoutError(f"parallel={values!r} is not valid; allowed: a mapping of ParallelConfig fields.")
        return cls(**dict(values))

    def resolve(self, world_size: int) -> "Layout":
        """Fill in ``"auto"`` sizes and check that the product equals ``world_size``."""
        return resolve_layout(self, world_size)


def _path_text(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@settings(LayoutError, "FiveDStrategy")
class StrategyOptions:
    """``FiveDStrategy``'s arguments other than the layout (checkpoints, weights, process group)."""

    checkpoint_format: EnumField(CheckpointFormat) = CheckpointFormat.SHARDED
    checkpoint_write: EnumField(CheckpointWrite) = CheckpointWrite.SYNC
    keep_last_k: Optional_(PositiveInt, "an integer >= 1, or None to keep every checkpoint") = None
    pretrained: Optional_(
        Annotated[str, BeforeValidator(_path_text), Field(min_length=1)],
        "a path to a .safetensors/.pt file or a Hugging Face folder, or None",
    ) = None
    pretrained_prefix: Optional_(str, "a key prefix such as 'model.', or None") = None
    process_group_backend: Optional_(
        Annotated[str, Field(min_length=1)], "a torch.distributed backend such as 'gloo' or 'nccl', or None"
    ) = None
    timeout: Optional_(
        Annotated[timedelta, Field(gt=timedelta(0))], "a positive datetime.timedelta, or None"
    ) = default_pg_timeout


@dataclass(frozen=True)
class Layout:
    """Resolved sizes; the mesh is built from exactly these numbers."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    rank_order: tuple[str, ...] = DEFAULT_RANK_ORDER

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        # ep borrows ranks from dp_shard x cp, so it does not multiply the world.
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in self.rank_order}

    def describe(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in self.rank_order]
        return " x ".join(parts) + f" (ep={self.ep}) = {self.world_size} ranks"

    def expert_ranks(self) -> torch.Tensor:
        """The global ranks as the expert mesh reads them, dims (pp, dp_replicate, edp_shard, ep, tp):
        ranks are row-major over ``rank_order``; dp_shard x cp is read dp_shard-major and cut into
        (edp_shard, ep), so ep borrows ranks that already hold different tokens."""
        ranks = torch.arange(self.world_size, dtype=torch.int).reshape([getattr(self, d) for d in self.rank_order])
        ranks = ranks.permute([self.rank_order.index(d) for d in DEFAULT_RANK_ORDER])
        edp_shard = self.dp_shard * self.cp // self.ep
        return ranks.reshape(self.pp, self.dp_replicate, edp_shard, self.ep, self.tp).contiguous()

    def expert_misread(self) -> str | None:
        """The expert dim (``edp_shard``, ``ep``, ``edp``) along which the ranks do not ascend, or None.
        A process group orders its members by global rank, the mesh by its coordinates: they
        agree only where the ranks ascend along every line of the dim."""
        ranks = self.expert_ranks()
        lines = {
            "edp_shard": ranks.movedim(2, -1).reshape(-1, ranks.shape[2]),
            "ep": ranks.movedim(3, -1).reshape(-1, ranks.shape[3]),
            "edp": ranks.permute(0, 3, 4, 1, 2).reshape(-1, ranks.shape[1] * ranks.shape[2]),  # dp_replicate x edp_shard
        }
        return next((name for name, line in lines.items() if not bool((line[:, 1:] > line[:, :-1]).all())), None)


def _coerce_enum(enum_cls: type[Enum], value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_cls`` (member, value or name), or a LayoutError naming ``name``."""
    try:
        return enum_member(enum_cls, value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise LayoutError(f"{name}={value!r} is not valid; choose one of {choices}.") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layout(config: ParallelConfig, world_size: int) -> Layout:
    if world_size < 1:
        raise LayoutError(f"world size {world_size} must be >= 1.")
    sizes = {d: getattr(config, d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    autos = [d for d, v in sizes.items() if v == AUTO]  # only the data dims may be "auto" (DataSize)
    if len(autos) == 2:
        sizes["dp_replicate"] = 1
        autos = ["dp_shard"]
    fixed = 1
    for d, v in sizes.items():
        if v != AUTO:
            fixed *= v
    if autos:
        (auto_dim,) = autos
        if world_size % fixed:
            fits = [w for w in range(fixed, 4 * fixed + 1, fixed)]
            raise LayoutError(
                f"world size {world_size} is not divisible by the fixed sizes' product {fixed} "
                f"({_product_text(sizes)}); run on a multiple of {fixed} processes (e.g. {fits[:3]}) "
                f"or choose sizes whose product divides {world_size} (divisors: {_divisors(world_size)})."
            )
        sizes[auto_dim] = world_size // fixed
    elif fixed != world_size:
        raise LayoutError(
            f"the layout's product {fixed} ({_product_text(sizes)}) does not match the world size "
            f"{world_size}; set dp_shard='auto' to absorb the rest, or make the product {world_size}."
        )
    ep = config.ep
    borrow = sizes["dp_shard"] * sizes["cp"]
    if borrow % ep:
        raise LayoutError(
            f"ep={ep} must divide dp_shard*cp={borrow} (expert parallelism borrows those ranks); "
            f"valid ep values here: {_divisors(borrow)}."
        )
    layout = Layout(**sizes, ep=ep, rank_order=config.rank_order)
    misread = layout.expert_misread() if ep > 1 else None
    if misread is not None:
        order = list(layout.rank_order)
        fixed_order = list(order)
        for position, dim in zip(sorted(order.index(d) for d in _EXPERT_READ_ORDER), _EXPERT_READ_ORDER):
            fixed_order[position] = dim
        raise LayoutError(
            f"rank_order={order} with ep={ep}: the expert groups read the ranks of dp_replicate, dp_shard "
            f"and cp in that order, and in this rank order a rank's place along {misread} is not its rank in "
            f"that group's collectives (expert shards would be exchanged out of place). Keep dp_replicate, "
            f"dp_shard, cp in that relative order: rank_order={fixed_order}."
        )
    return layout


# The order in which the expert mesh reads the data dims' ranks (Layout.expert_ranks).
_EXPERT_READ_ORDER = ("dp_replicate", "dp_shard", "cp")


def _product_text(sizes: Mapping[str, Any]) -> str:
    return " * ".join(f"{d}={v}" for d, v in sizes.items())


def _changed(section: Any) -> list[str]:
    """The fields of a settings section that differ from their defaults."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def ineffective_settings(config: ParallelConfig) -> list[str]:
    """Settings that the layout makes meaningless: a section of a dimension that is off, or an
    option whose switch is off. Each entry names the setting and what would make it count."""
    found: list[str] = []
    for size, section in (("pp", "pipeline"), ("cp", "context")):
        changed = _changed(getattr(config, section))
        if getattr(config, size) == 1 and changed:
            keys = ", ".join(f"{section}.{k}" for k in changed)
            found.append(f"{keys} (only used with {size} > 1; {size}=1)")
    if config.cp > 1 and config.context.mode is not ContextParallelMode.HYBRID and config.context.ulysses is not None:
        found.append(f"context.ulysses (only used with context.mode='hybrid'; mode={config.context.mode.value!r})")
    if config.tp == 1 and config.sequence_parallel:
        found.append("sequence_parallel=True (only used with tp > 1; tp=1)")
    expert = config.expert
    if expert.load_balancing != LoadBalancing.AUX_LOSS and "aux_loss_coef" in _changed(expert):
        found.append("expert.aux_loss_coef (only used with expert.load_balancing='aux_loss')")
    if expert.load_balancing != LoadBalancing.BIAS and "bias_update_rate" in _changed(expert):
        found.append("expert.bias_update_rate (only used with expert.load_balancing='bias')")
    if expert.capacity_factor is None and "drop_policy" in _changed(expert):
        found.append("expert.drop_policy (only used with an expert.capacity_factor)")
    if config.zero == ZeroStage.PARAMETERS and "bucket_size_mb" in _changed(config):
        found.append("bucket_size_mb (used by ZeRO-0..2; zero=3 reduces per FSDP2 unit)")
    return found
