"""The order in which the dimensions change a model, and what each adds to a training step.

The data path (docs/architecture.md): config -> mesh -> discover -> apply the steps below,
in order -> step -> reduce -> checkpoint. ``FiveDStrategy.setup`` calls
:func:`apply_dimensions` once per module; what the steps build is one
:class:`~lightning_5d.applied.AppliedDimensions` (``applied.py``), which the strategy's
step, backward, clipping and checkpoint hooks ask instead of knowing each dimension.

:data:`STEPS` is torchtitan's order: prepare (precision cast, rank 0's weights everywhere)
-> discover (the ModelPlan, if an active step reads it) -> snapshot (weightless copies for
verify) -> precision (FP8 linears) -> tensor -> expert -> context -> activation
checkpointing -> pipeline -> data (ZeRO-0..2 or FSDP2; a meta-built model is materialized
here) -> verify. Every step has a name and the same small interface: ``wanted`` (does this layout
use it), ``needs_plan`` (does it read the discovered ModelPlan), ``check`` (refusals; all
active steps check before any applies, so a refused layout never half-changes the module)
and ``apply`` (changes the module, records its runtime object on ``ctx.applied``). Adding
a step (a sixth dimension) is one :class:`Step` subclass and one entry in the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_5d.applied import AppliedDimensions
from lightning_5d.config import (
    ActivationCheckpointing,
    Layout,
    LoadBalancing,
    ParallelConfig,
    PipelineSchedule,
    ZeroStage,
)
from lightning_5d.heap import release_freed_memory
from lightning_5d.materialize import MetaBuild
from lightning_5d.layout_rules import (
    Combination,
    ep_sequence_parallel,
    fp32_accumulation_pp,
    fp8_all_gather_zero,
    hsdp_zero3_cp,
)
from lightning_5d.mesh import ParallelMesh
from lightning_5d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_5d.parallel.context import ContextParallel
from lightning_5d.parallel.data import DataGroups, ZeroDataParallel, ZeroSet, apply_fsdp, broadcast_module
from lightning_5d.parallel.data.fsdp import apply_expert_fsdp, apply_fp8_gather_units
from lightning_5d.parallel.expert import ExpertParallel, ExpertParallelError
from lightning_5d.parallel.pipeline import PipelineLoop, PipelineParallel
from lightning_5d.parallel.pipeline.fsdp import adopt_stage_units
from lightning_5d.parallel.pipeline.loop import check_pipeline_supported
from lightning_5d.parallel.tensor import TensorParallel
from lightning_5d.parallel.token_mean import LossGroups
from lightning_5d.plan import describe, discover
from lightning_5d.plan.blocks import ModelMappingError, find_blocks, require_blocks
from lightning_5d.plan.model_plan import ModelPlan
from lightning_5d.precision import FiveDPrecision, PrecisionError
from lightning_5d.verify import PlanCheck


@dataclass
class ApplyContext:
    """What every step reads: the module, the settings, the mesh, and what earlier steps built."""

    module: nn.Module
    config: ParallelConfig
    mesh: ParallelMesh
    precision: FiveDPrecision | None
    combination: Combination
    applied: AppliedDimensions
    plan: ModelPlan | None = None
    plan_needed: bool = False
    plan_check: PlanCheck | None = None  # weightless copies of the pieces, taken before any dimension
    meta: MetaBuild | None = None  # a model built on the meta device, filled per shard after the cuts
    device: torch.device | None = None  # where the materialized pieces go

    @property
    def meta_built(self) -> bool:
        return self.meta is not None and self.meta.active

    def materialize(self) -> None:
        """Fill each rank's pieces of a meta-built model with one process's initial values (after
        every cut that decides what this rank holds; lightning_5d.materialize)."""
        if self.meta_built:
            applied = self.applied
            self.meta.materialize(self.module, self.device, [applied.tp, applied.ep, applied.pp])
            # Materializing puts new Parameter objects in place of the meta ones, and the hooks
            # the tensor step registered on those (tp's partial-gradient sums: SP's norms, per-head
            # q/k norms) went with them: register them on the real parameters.
            if applied.tp is not None and applied.tp.has_partial_grads and self.config.zero != ZeroStage.PARAMETERS:
                applied.tp.register_sequence_parallel_grad_hooks(self.module)

    @property
    def layout(self) -> Layout:
        return self.combination.layout

    @property
    def fp8(self) -> bool:
        return self.precision is not None and self.precision.fp8 is not None

    @property
    def experts_wanted(self) -> bool:
        # Capacity and load balancing need our dispatch even when every expert is local.
        return self.layout.ep > 1 or self.config.expert.wants_dispatch


class Step(ABC):
    """One named step of :data:`STEPS`."""

    name: str

    def wanted(self, ctx: ApplyContext) -> bool:
        return True

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return False

    def check(self, ctx: ApplyContext) -> None:
        """Raise with the reason and a fix when the layout cannot run; nothing is changed yet."""

    @abstractmethod
    def apply(self, ctx: ApplyContext) -> None: ...


class Prepare(Step):
    name = "prepare"

    def apply(self, ctx: ApplyContext) -> None:
        if ctx.precision is not None and ctx.config.zero != ZeroStage.PARAMETERS:
            ctx.precision.cast_parameters(ctx.module)  # ZeRO-3 keeps fp32 shards: FSDP2 casts per all-gather
        if not ctx.meta_built:  # a meta-built model is filled from its recorded init on every rank alike
            broadcast_module(ctx.module, ctx.mesh)


class Discover(Step):
    """Observe the model once (``lightning_5d.plan``) when an active step reads the ModelPlan."""

    name = "discover"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.plan_needed

    def apply(self, ctx: ApplyContext) -> None:
        # A meta-built model's probe forwards compute with its recorded initial values.
        values = (lambda: ctx.meta.values(ctx.module)) if ctx.meta_built else None
        ctx.plan = discover(ctx.module, ctx.config.model_plan, values=values)
        if ctx.meta_built:
            release_freed_memory()  # the probes' recomputed values, before the rank's shards are filled
        rank_zero_info(f"[lightning_5d] model plan:\n{describe(ctx.plan)}")


class SnapshotPieces(Step):
    """Weightless (meta) copies of the embedding, blocks and head before any dimension changes
    them: the unparallelized pieces :class:`Verify` compares against (``lightning_5d.verify``)."""

    name = "snapshot"

    def apply(self, ctx: ApplyContext) -> None:
        # ctx.plan_needed: tp, cp, pp, expert dispatch or FP8 will rewrite the forward.
        ctx.plan_check = PlanCheck.before(ctx.module, ctx.plan, ctx.config, rewrites=ctx.plan_needed)


class Verify(Step):
    """Prove the applied plan: each piece this rank holds against its unparallelized copy, on a
    probe input, before any training step (``verify="off"`` skips it)."""

    name = "verify"

    def apply(self, ctx: ApplyContext) -> None:
        if ctx.plan_check is None:
            return
        applied = ctx.applied
        report = ctx.plan_check.after(
            ctx.module, mesh=ctx.mesh, tp=applied.tp, cp=applied.cp, pp=applied.pp, ep=applied.ep,
            precision=ctx.precision,
        )  # fmt: skip
        if report is not None:
            rank_zero_info(f"[lightning_5d] plan verified: {report.summary()}")


class Precision(Step):
    """FP8 training linears (plan: the linears); bf16 casting happened in ``prepare``."""

    name = "precision"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.precision is not None

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return ctx.fp8

    def check(self, ctx: ApplyContext) -> None:
        assert ctx.precision is not None
        check_precision_supported(ctx.precision, ctx.combination, ctx.config)

    def apply(self, ctx: ApplyContext) -> None:
        precision = ctx.precision
        assert precision is not None
        if ctx.fp8:
            ac = ctx.config.activation_checkpointing != ActivationCheckpointing.NONE
            layout = {"tp": ctx.mesh.size("tp"), "pp": ctx.mesh.size("pp"), "ep": ctx.layout.ep}
            precision.apply_fp8(ctx.module, ctx.plan, layout, ac, ctx.mesh.group("dp_cp"), experts=ctx.experts_wanted)
        rank_zero_info(f"[lightning_5d] precision: {precision.describe()}")


class Tensor(Step):
    """TP (+SP) (plan: projections, their column layouts, heads, norms, embedding and head)."""

    name = "tensor"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.mesh.size("tp") > 1

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return True

    def apply(self, ctx: ApplyContext) -> None:
        sp = ctx.config.sequence_parallel
        tp = TensorParallel(ctx.module, ctx.plan, ctx.mesh["tp"], sp)
        if tp.has_partial_grads and ctx.config.zero != ZeroStage.PARAMETERS:
            tp.register_sequence_parallel_grad_hooks(ctx.module)
        ctx.applied.tp = tp


class Expert(Step):
    """MoE dispatch, under ep > 1 or when capacity / load balancing is asked for (plan: routers, experts)."""

    name = "expert"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.experts_wanted

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return True

    def check(self, ctx: ApplyContext) -> None:
        why = ep_sequence_parallel(ctx.combination)
        if why is not None:
            raise ExpertParallelError(why)
        if ctx.config.expert.load_balancing == LoadBalancing.AUX_LOSS and ctx.combination.loss_scaling:
            raise ExpertParallelError(
                "expert.load_balancing=aux_loss with precision='16-mixed': the GradScaler scales the user's loss but "
                "not the aux term, which would then count 1/scale as much. Use precision='bf16-mixed' or '32-true', "
                "or load_balancing=bias."
            )

    def apply(self, ctx: ApplyContext) -> None:
        ctx.applied.ep = ExpertParallel(ctx.module, ctx.plan, ctx.mesh, ctx.config.expert)


class Context(Step):
    """CP (plan: the attention calls and where positions enter)."""

    name = "context"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.mesh.size("cp") > 1

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return True

    def apply(self, ctx: ApplyContext) -> None:
        cp = ContextParallel(ctx.module, ctx.plan, ctx.mesh["cp"], ctx.config.context,
                             hybrid_groups=ctx.mesh.context_groups, tp=ctx.mesh.size("tp"))  # fmt: skip
        rank_zero_info(f"[lightning_5d] context parallel: {cp.describe()}")
        ctx.applied.cp = cp


class ActivationCheckpointingStep(Step):
    """Recompute per block (the repeated blocks, found without the plan)."""

    name = "activation_checkpointing"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.config.activation_checkpointing != ActivationCheckpointing.NONE

    def apply(self, ctx: ApplyContext) -> None:
        mode = ctx.config.activation_checkpointing
        _, blocks = require_blocks(ctx.module, f"activation_checkpointing={mode.value}")
        apply_activation_checkpointing(blocks, mode)


class Pipeline(Step):
    """PP stages (plan: the ordered blocks, embedding, final norm, head)."""

    name = "pipeline"

    def wanted(self, ctx: ApplyContext) -> bool:
        return ctx.mesh.size("pp") > 1

    def needs_plan(self, ctx: ApplyContext) -> bool:
        return True

    def check(self, ctx: ApplyContext) -> None:
        check_pipeline_supported(ctx.module, ctx.combination)

    def apply(self, ctx: ApplyContext) -> None:
        pp = PipelineParallel(ctx.module, ctx.plan, ctx.mesh, ctx.config.pipeline)
        ctx.applied.pp, ctx.applied.pp_loop = pp, PipelineLoop(pp, ctx.config.pipeline.log_bubble)
        if ctx.applied.ep is not None:
            ctx.applied.ep.drop_absent(ctx.module)
        rank_zero_info(f"[lightning_5d] pipeline: {pp.describe()}")


class Data(Step):
    """ZeRO-3 as FSDP2 units, ZeRO-0..2 engines (experts reduce over their own group), or nothing
    when no rank shares this one's data shard; and the ranks a step's cross-entropy is a mean over
    (``parallel/token_mean.py``: dp x cp, where the gradients are averaged)."""

    name = "data"

    def check(self, ctx: ApplyContext) -> None:
        why = hsdp_zero3_cp(ctx.combination)
        if why is not None:
            raise ModelMappingError(why)

    def apply(self, ctx: ApplyContext) -> None:
        mesh = ctx.mesh
        ctx.applied.loss_groups = LossGroups(
            train=(mesh.group("dp_cp"), mesh.size("dp_cp")), eval=(mesh.group("cp"), mesh.size("cp"))
        )
        if ctx.config.zero == ZeroStage.PARAMETERS:
            self._fsdp(ctx)
            return
        ctx.materialize()  # ZeRO-0..2 engines take the real parameters
        if ctx.layout.ep > 1 or ctx.mesh.size("dp_cp") > 1:
            ctx.applied.zero = ZeroSet(self._engines(ctx))
        # else: no data-parallel peers, nothing to reduce or shard: plain single-rank training.

    def _fsdp(self, ctx: ApplyContext) -> None:
        applied, precision, module, ep = ctx.applied, ctx.precision, ctx.module, ctx.layout.ep
        # A pipeline stage's blocks from the pipeline (its ModuleDict of blocks keeps global keys: with
        # find_blocks the last stage found none, and each of its linears and norms became a unit).
        blocks = applied.pp.held_blocks if applied.pp is not None else find_blocks(module)[1]
        policy = precision.fsdp_policy() if precision is not None else None
        inner = apply_expert_fsdp(applied.ep, ctx.mesh, policy) if ep > 1 else []
        if ctx.fp8 and precision.fp8.fp8_all_gather:
            # Experts under ep > 1 are their own units on another mesh: they gather in bf16.
            dense = [n for n in precision.fp8_names if ep == 1 or not applied.ep.is_expert(f"{n}.weight")]
            names = precision.enable_fp8_all_gather(module, dense)
            linears = [module.get_submodule(n) for n in names]
            inner = inner + apply_fp8_gather_units(linears, ctx.mesh, precision.reduce_dtype)
        units = apply_fsdp(module, blocks, ctx.mesh, policy, inner, root_holds_blocks=applied.pp is not None)
        applied.fsdp_units = inner + units
        # After fully_shard (each rank allocates only its shards), before pp's lazy init of the units.
        ctx.materialize()
        if applied.pp is not None:
            adopt_stage_units(applied.fsdp_units)
            applied.pp.divide_loss_by_microbatches = True

    def _engines(self, ctx: ApplyContext) -> list[ZeroDataParallel]:
        precision, config = ctx.precision, ctx.config
        engine = dict(
            reduce_dtype=precision.reduce_dtype if precision is not None else None,
            accumulate_in_masters=precision is not None and precision.fp32_accumulation,
        )
        args = (ctx.module, ctx.mesh, config.zero, config.bucket_size_mb)
        if ctx.layout.ep == 1:
            return [ZeroDataParallel(*args, **engine)]
        # Expert gradients reduce over the ranks holding the same experts, the rest over dp x cp.
        is_expert = ctx.applied.ep.is_expert
        return [
            ZeroDataParallel(*args, owns=lambda n: not is_expert(n), **engine),
            ZeroDataParallel(*args, groups=DataGroups.experts(ctx.mesh), owns=is_expert, **engine),
        ]


STEPS: tuple[Step, ...] = (
    Prepare(),
    Discover(),
    SnapshotPieces(),
    Precision(),
    Tensor(),
    Expert(),
    Context(),
    ActivationCheckpointingStep(),
    Pipeline(),
    Data(),
    Verify(),
)


def _plan_needed(ctx: ApplyContext, steps: Sequence[Step]) -> bool:
    """Whether an active step rewrites the forward: it then needs the model's plan, and setup
    checks the plan (``ParallelConfig.checks_plan``)."""
    return any(step.needs_plan(ctx) and step.wanted(ctx) for step in steps)


def rewrites_forward(
    config: ParallelConfig, mesh: ParallelMesh, precision: FiveDPrecision | None, combination: Combination
) -> bool:
    """:func:`_plan_needed` over :data:`STEPS` without a model (for the start-up dry run): which
    steps rewrite the forward depends on the settings, the mesh and the precision only."""
    module = nn.Module()
    return _plan_needed(ApplyContext(module, config, mesh, precision, combination, AppliedDimensions(module=module)),
                        STEPS)  # fmt: skip


def apply_dimensions(
    module: nn.Module, config: ParallelConfig, mesh: ParallelMesh, precision: FiveDPrecision | None,
    combination: Combination, steps: Sequence[Step] = STEPS, *, meta: MetaBuild | None = None,
    device: torch.device | None = None,
) -> AppliedDimensions:  # fmt: skip
    """Run the active ``steps`` on ``module``: every check first, then every apply, in order.

    ``meta``: the record of a model built on the meta device; its pieces are materialized on
    ``device`` once the data step knows what each rank holds.
    """
    ctx = ApplyContext(module, config, mesh, precision, combination, AppliedDimensions(module=module))
    ctx.meta, ctx.device = meta, device
    ctx.plan_needed = _plan_needed(ctx, steps)
    active = [step for step in steps if step.wanted(ctx)]
    for step in active:
        step.check(ctx)
    for step in active:
        step.apply(ctx)
    ctx.applied.watch_frozen(module)
    return ctx.applied


def combination_for(
    config: ParallelConfig, layout: Layout, precision: FiveDPrecision | None, loss_scaling: bool
) -> Combination:
    """The resolved layout and the options ``layout_rules`` reads (shared with the planner)."""
    pipe = config.pipeline
    return Combination(
        layout,
        zero=config.zero,
        sequence_parallel=config.sequence_parallel,
        schedule=PipelineSchedule(pipe.schedule),
        virtual_stages=pipe.virtual_stages,
        microbatches=pipe.microbatches,
        fp32_accumulation=precision is not None and precision.fp32_accumulation,
        loss_scaling=loss_scaling,
        fp8_all_gather=precision is not None and precision.fp8 is not None and precision.fp8.fp8_all_gather,
    )


def check_precision_supported(precision: FiveDPrecision, combination: Combination, config: ParallelConfig) -> None:
    why = fp32_accumulation_pp(combination) or fp8_all_gather_zero(combination)
    if why is not None:
        raise PrecisionError(why)
    pp, ep = combination.layout.pp, combination.layout.ep
    experts = ep > 1 or config.expert.wants_dispatch
    if precision.guard.every and (pp > 1 or experts):
        raise PrecisionError(
            f"numerics_check_every={precision.guard.every} with pp={pp}, ep={ep}: the check runs the step's "
            f"forward a second time, which a pipeline schedule does not allow and which would count the "
            f"expert load twice; set numerics_check_every=0 there, or check on a pp=1 layout without "
            f"expert dispatch."
        )
