"""Layout and parallelism settings, validated before any process group starts.

``ParallelConfig`` is what users write (Python keyword arguments or a Hydra ``parallel:``
group); ``Layout`` is the resolved, immutable set of sizes the mesh is built from. Every
error names the offending value and a value that would work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, Mapping, Sequence, Union

AUTO = "auto"
SizeSpec = Union[int, str]

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


class SequenceSharding(str, Enum):
    """How the sequence is cut over the cp ranks."""

    ZIGZAG = "zigzag"  # 2*cp chunks, rank r holds r and 2*cp-1-r: equal causal work per rank
    CONTIGUOUS = "contiguous"  # cp chunks in order: rank r does r+1 causal blocks


class StageBalance(str, Enum):
    """How blocks are spread over the pipeline stages when no boundaries are given."""

    PARAMETERS = "parameters"  # equal block parameters per stage
    COST = "cost"  # equal matmul work: the head's parameters count on the last stage too


@dataclass
class PipelineConfig:
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    microbatches: int | None = None  # None: 2 * pp, enough to keep the 1F1B bubble < 1/3
    virtual_stages: int = 1
    balance: StageBalance = StageBalance.COST
    # Blocks per stage, in stage order (pp * virtual_stages entries); overrides `balance`.
    stage_blocks: list[int] | None = None
    log_bubble: bool = False  # log the measured idle fraction of each step as `pp_bubble`


@dataclass
class ContextConfig:
    mode: ContextParallelMode = ContextParallelMode.RING
    sharding: SequenceSharding = SequenceSharding.ZIGZAG


class LoadBalancing(str, Enum):
    """How routers are pushed towards even expert load."""

    NONE = "none"  # the model's own routing, untouched: numbers match one process by default
    AUX_LOSS = "aux_loss"  # Switch/GShard auxiliary loss, weighted by aux_loss_coef
    BIAS = "bias"  # DeepSeek-V3's aux-loss-free per-expert selection bias, moved by bias_update_rate


class DropPolicy(str, Enum):
    """Which assignments an over-full expert keeps when a capacity factor is set."""

    PROBABILITY = "probability"  # the highest router weights (GShard, Megatron's "probs")
    POSITION = "position"  # the earliest tokens in the batch (Switch)


@dataclass
class ExpertConfig:
    capacity_factor: float | None = None  # None: dropless
    drop_policy: DropPolicy = DropPolicy.PROBABILITY
    load_balancing: LoadBalancing = LoadBalancing.NONE
    aux_loss_coef: float = 0.01  # Switch Transformer's value
    bias_update_rate: float = 0.001  # DeepSeek-V3's gamma
    log_load: bool = True  # log tokens per expert, load imbalance and dropped tokens (moe/...)

    @property
    def wants_dispatch(self) -> bool:
        """Whether these settings change routing or the loss (then they apply at ep=1 too)."""
        return self.capacity_factor is not None or self.load_balancing != LoadBalancing.NONE


@dataclass
class ParallelConfig:
    """Everything that decides how a model is split. Sizes may be ``"auto"``."""

    dp_replicate: SizeSpec = 1
    dp_shard: SizeSpec = AUTO
    cp: SizeSpec = 1
    tp: SizeSpec = 1
    pp: SizeSpec = 1
    ep: SizeSpec = 1
    zero: ZeroStage = ZeroStage.OPTIMIZER
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    # Shard norms, dropout and residuals along the sequence between the TP regions.
    sequence_parallel: bool = False
    # Module-path patterns -> roles, for models discovery cannot map (see docs/model_plans.md).
    model_plan: dict[str, str] | None = None
    rank_order: tuple[str, ...] = DEFAULT_RANK_ORDER
    # 25 MB matches DDP's default: large enough to amortize launch cost, small enough to overlap.
    bucket_size_mb: float = 25.0
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    expert: ExpertConfig = field(default_factory=ExpertConfig)

    def __post_init__(self) -> None:
        self.zero = _coerce_enum(ZeroStage, self.zero, "zero")
        self.activation_checkpointing = _coerce_enum(
            ActivationCheckpointing, self.activation_checkpointing, "activation_checkpointing"
        )
        for name in ("pipeline", "context", "expert"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _section_from_mapping(_SECTIONS[name], value, name))
        self.pipeline.schedule = _coerce_enum(PipelineSchedule, self.pipeline.schedule, "pipeline.schedule")
        self.pipeline.balance = _coerce_enum(StageBalance, self.pipeline.balance, "pipeline.balance")
        if self.pipeline.stage_blocks is not None:
            self.pipeline.stage_blocks = [int(n) for n in self.pipeline.stage_blocks]
        self.context.mode = _coerce_enum(ContextParallelMode, self.context.mode, "context.mode")
        self.context.sharding = _coerce_enum(SequenceSharding, self.context.sharding, "context.sharding")
        self.expert.drop_policy = _coerce_enum(DropPolicy, self.expert.drop_policy, "expert.drop_policy")
        self.expert.load_balancing = _coerce_enum(LoadBalancing, self.expert.load_balancing, "expert.load_balancing")
        if self.expert.capacity_factor is not None and not float(self.expert.capacity_factor) > 0:
            raise LayoutError(
                f"expert.capacity_factor={self.expert.capacity_factor} must be > 0 (e.g. 1.25), or null for dropless."
            )
        self.rank_order = tuple(self.rank_order)
        if not isinstance(self.sequence_parallel, bool):
            raise LayoutError(f"sequence_parallel={self.sequence_parallel!r} must be true or false.")
        if self.model_plan is not None:
            if not isinstance(self.model_plan, Mapping):
                raise LayoutError(f"model_plan must map module-path patterns to roles, got {self.model_plan!r}.")
            self.model_plan = {str(k): str(v) for k, v in self.model_plan.items()}
        _check_rank_order(self.rank_order)
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            setattr(self, name, _check_size(name, getattr(self, name)))
        if self.bucket_size_mb <= 0:
            raise LayoutError(f"bucket_size_mb={self.bucket_size_mb} must be > 0 (default 25).")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ParallelConfig":
        return _section_from_mapping(cls, values, "parallel")

    def resolve(self, world_size: int) -> "Layout":
        """Fill in ``"auto"`` sizes and check that the product equals ``world_size``."""
        return resolve_layout(self, world_size)


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


_SECTIONS = {"pipeline": PipelineConfig, "context": ContextConfig, "expert": ExpertConfig}


def _section_from_mapping(cls: type, values: Mapping[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LayoutError(f"Unknown key(s) {unknown} in `{where}`; valid keys are {sorted(known)}.")
    return cls(**dict(values))


def _coerce_enum(enum_cls: type[Enum], value: Any, name: str) -> Any:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, Enum):
        value = value.value
    try:
        return enum_cls(value)
    except ValueError:
        if isinstance(value, str) and issubclass(enum_cls, IntEnum) and value.isdigit():
            return enum_cls(int(value))
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise LayoutError(f"{name}={value!r} is not valid; choose one of {choices}.") from None


def _check_size(name: str, value: Any) -> SizeSpec:
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        else:
            raise LayoutError(f"{name}={value!r} must be a positive integer or 'auto'.")
    if value < 1:
        raise LayoutError(f"{name}={value} must be >= 1 (use 1 to leave the dimension off).")
    return value


def _check_rank_order(order: Sequence[str]) -> None:
    if sorted(order) != sorted(MESH_DIMS):
        raise LayoutError(
            f"rank_order={list(order)} must list each of {sorted(MESH_DIMS)} exactly once, "
            f"outermost first; the default is {list(DEFAULT_RANK_ORDER)}."
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_layout(config: ParallelConfig, world_size: int) -> Layout:
    if world_size < 1:
        raise LayoutError(f"world size {world_size} must be >= 1.")
    sizes = {d: getattr(config, d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}
    autos = [d for d, v in sizes.items() if v == AUTO]
    # Only the data dims can absorb the rest of the world; model dims change the math.
    for d in autos:
        if d not in ("dp_replicate", "dp_shard"):
            raise LayoutError(f"{d}='auto' is not supported; give {d} an integer (1 leaves it off).")
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
    if ep == AUTO:
        raise LayoutError("ep='auto' is not supported; give ep an integer (1 leaves it off).")
    borrow = sizes["dp_shard"] * sizes["cp"]
    if borrow % ep:
        raise LayoutError(
            f"ep={ep} must divide dp_shard*cp={borrow} (expert parallelism borrows those ranks); "
            f"valid ep values here: {_divisors(borrow)}."
        )
    return Layout(**sizes, ep=ep, rank_order=config.rank_order)


def _product_text(sizes: Mapping[str, Any]) -> str:
    return " * ".join(f"{d}={v}" for d, v in sizes.items())


def validate_early(config: ParallelConfig) -> None:
    """Checks that need no world size; run in the strategy's constructor."""
    pipe = config.pipeline
    if pipe.virtual_stages < 1:
        raise LayoutError(f"pipeline.virtual_stages={pipe.virtual_stages} must be >= 1.")
    if pipe.microbatches is not None and pipe.microbatches < 1:
        raise LayoutError(f"pipeline.microbatches={pipe.microbatches} must be >= 1.")
    if config.pp != AUTO and config.pp > 1:
        from lightning_5d.parallel.pipeline_schedule import check_schedule, default_microbatches

        v = pipe.virtual_stages
        check_schedule(pipe.schedule, config.pp, v, pipe.microbatches or default_microbatches(config.pp, v))
        if pipe.stage_blocks is not None and len(pipe.stage_blocks) != config.pp * v:
            raise LayoutError(
                f"pipeline.stage_blocks={pipe.stage_blocks} has {len(pipe.stage_blocks)} entries; pp={config.pp} x "
                f"virtual_stages={v} needs {config.pp * v} (blocks per stage, in stage order)."
            )
