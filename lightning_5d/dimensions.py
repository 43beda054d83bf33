"""The order in which the dimensions change a model, and what each adds to a training step.

The data path (docs/architecture.md): config -> mesh -> discover -> apply the steps below,
in order -> step -> reduce -> checkpoint. ``FiveDStrategy.setup`` calls
:func:`apply_dimensions` once per module; what the steps build is one
:class:`AppliedDimensions`, which the strategy's step, backward, clipping and checkpoint
hooks ask instead of knowing each dimension.

:data:`STEPS` is torchtitan's order: prepare (precision cast, rank 0's weights everywhere)
-> discover (the ModelPlan, if an active step reads it) -> precision (FP8 linears) ->
tensor -> expert -> context -> activation checkpointing -> pipeline -> data (ZeRO-0..2 or
FSDP2). Every step has a name and the same small interface: ``wanted`` (does this layout
use it), ``needs_plan`` (does it read the discovered ModelPlan), ``check`` (refusals; all
active steps check before any applies, so a refused layout never half-changes the module)
and ``apply`` (changes the module, records its runtime object on ``ctx.applied``). Adding
a step (a sixth dimension, a verification after "data", materializing from the meta
device) is one :class:`Step` subclass and one entry in the list.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_5d.config import (
    ActivationCheckpointing,
    Layout,
    LayoutError,
    LoadBalancing,
    ParallelConfig,
    PipelineSchedule,
    ZeroStage,
)
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
from lightning_5d.parallel.context import ContextParallel, ContextParallelError
from lightning_5d.parallel.data import DataGroups, ZeroDataParallel, ZeroSet, apply_fsdp, broadcast_module
from lightning_5d.parallel.data.fsdp import apply_expert_fsdp, apply_fp8_gather_units, set_gradient_sync
from lightning_5d.parallel.expert import ExpertParallel, ExpertParallelError
from lightning_5d.parallel.grad_norm import clip_grad_norm_
from lightning_5d.parallel.pipeline import PipelineLoop, PipelineMode, PipelineParallel
from lightning_5d.parallel.pipeline.fsdp import adopt_stage_units
from lightning_5d.parallel.pipeline.loop import check_pipeline_supported
from lightning_5d.parallel.tensor import TensorParallel
from lightning_5d.parallel.tensor.vocab import loss_parallel_region
from lightning_5d.plan import describe, discover
from lightning_5d.plan.blocks import ModelMappingError, find_blocks, require_blocks
from lightning_5d.plan.model_plan import ModelPlan
from lightning_5d.precision import FiveDPrecision, PrecisionError
from lightning_5d.verify import PlanCheck


@dataclass
class AppliedDimensions:
    """What the steps built for one module, and what that adds to every training step."""

    module: nn.Module | None = None
    tp: TensorParallel | None = None
    ep: ExpertParallel | None = None
    cp: ContextParallel | None = None
    pp: PipelineParallel | None = None
    pp_loop: PipelineLoop | None = None
    zero: ZeroSet | None = None  # ZeRO-0..2 engines; None under ZeRO-3 or without data-parallel peers
    fsdp_units: list = field(default_factory=list)  # ZeRO-3 (FSDP2) units
    _tp_sharded: set[int] = field(default_factory=set)  # ids of parameters (and masters) clipping sees
    _experts: set[int] = field(default_factory=set)

    # ------------------------------------------------------------------ re-entry
    def already_applied(self, module: nn.Module) -> bool:
        """Whether ``module`` already runs under these dimensions (fit after validate, a second fit).

        The same module: the ZeRO engines wake up again, nothing is applied twice. Another module
        is refused once a dimension holds state of the first (stages, ZeRO hooks, FSDP units);
        without such state it is simply parallelized afresh.
        """
        if self.module is None:
            return False
        if module is self.module:
            if self.zero is not None:
                self.zero.active = True
            return True
        if self.pp is not None or self.zero is not None or self.fsdp_units:
            raise LayoutError(
                "this FiveDStrategy already applied its dimensions to another module (pipeline stages, ZeRO "
                "hooks or FSDP units belong to it); use a new Trainer (and strategy) for a different module."
            )
        return False

    def check_predict(self) -> None:
        if self.cp is not None:
            raise ContextParallelError(
                f"predict under cp={self.cp.size} would return each rank's sequence shard; run predict with a "
                f"FiveDStrategy with cp=1 (checkpoints hold full tensors and load there unchanged)."
            )
        if self.ep is not None and self.ep.ep > 1:
            raise ExpertParallelError(
                f"predict under ep={self.ep.ep}: Lightning's predict sampler may give data ranks different numbers "
                f"of batches, and a rank that runs out would leave its ep peers waiting in the all-to-all. Run "
                f"predict with ep=1 (weights-only checkpoints hold every expert and load there unchanged)."
            )

    def deactivate(self) -> None:
        if self.zero is not None:
            self.zero.active = False  # hooks stay for a later fit/validate with this Trainer

    # ------------------------------------------------------------------ checkpoint
    @property
    def splits(self) -> list:
        """tp, ep and pp in that order: each turns full tensors into its pieces and back."""
        return [x for x in (self.tp, self.ep, self.pp) if x is not None]

    # ------------------------------------------------------------------ step
    @contextmanager
    def step_region(self, module: nn.Module) -> Iterator[None]:
        with ExitStack() as stack:
            if self.tp is not None:  # the user's F.cross_entropy on vocab-sharded logits
                stack.enter_context(loss_parallel_region())
            if self.cp is not None:  # inside TP's: sees F.cross_entropy first, makes it sequence-global
                stack.enter_context(self.cp.step_region(module))
            yield

    def run_step(self, module: nn.Module, step: Callable[..., Any], args: tuple, kwargs: dict, keep_shard: bool) -> Any:
        """The user's step on this rank's sequence shard; ``keep_shard`` leaves it current for backward."""
        cp = self.cp
        if cp is not None and args:
            args = (cp.begin(args[0]), *args[1:])
        if self.fsdp_units and self.fsdp_units[-1] is module:
            step = _through_forward(module, step)
        try:
            with self.step_region(module):
                out = step(*args, **kwargs)
        except BaseException:
            if cp is not None:
                cp.end()
            raise
        if cp is not None and not keep_shard:
            cp.end()
        return out

    def pipeline_step(
        self, module: nn.Module, mode: PipelineMode, step: Callable[..., Any], args: tuple, kwargs: dict,
        device: torch.device,
    ) -> Any:  # fmt: skip
        """One Lightning batch as one pipeline run; the user's step runs per microbatch on each stage."""
        assert self.pp_loop is not None
        batch, rest = args[0], args[1:]
        return self.pp_loop.run(
            mode,
            lambda mb: step(mb, *rest, **kwargs),
            batch,
            zero=self.zero,
            fsdp_units=self.fsdp_units,
            cp=self.cp,
            step_region=lambda: self.step_region(module),
            device=device,
        )

    @contextmanager
    def expert_step(self, module: Any) -> Iterator[None]:
        """Around a training step under expert dispatch: load counts and the aux loss for this step."""
        if self.ep is None:
            yield
            return
        # The aux loss enters the gradient as the user's loss does: after Lightning's 1/accumulate.
        self.ep.aux_scale = 1.0 / module.trainer.accumulate_grad_batches
        self.ep.start_step()
        yield
        self.ep.after_step(module)

    # ------------------------------------------------------------------ reduce
    @contextmanager
    def gradient_sync_paused(self) -> Iterator[None]:
        if self.zero is not None:
            self.zero.require_sync = False
        set_gradient_sync(self.fsdp_units, False)
        try:
            yield
        finally:
            if self.zero is not None:
                self.zero.require_sync = True
            set_gradient_sync(self.fsdp_units, True)

    def start_backward(self) -> None:
        if self.zero is not None:
            self.zero.start_backward()

    def finish_gradient_sync(self) -> None:
        if self.zero is not None:
            self.zero.finish_gradient_sync()

    def sync_sequence_parallel(self, module: nn.Module, accumulating: bool) -> None:
        # FSDP2 reduced this step's gradients; SP's norm weights and per-head q/k norms still
        # need their sum over tp.
        if self.tp is not None and self.fsdp_units and self.tp.has_partial_grads and not accumulating:
            self.tp.sync_sequence_parallel_grads(module)

    def pipeline_backward(self, module: nn.Module, accumulating: bool) -> None:
        """The schedule already ran the backward: restore its gradients and reduce them all now."""
        assert self.pp_loop is not None
        self.start_backward()  # as before any backward: it may clear the module's gradients
        self.pp_loop.restore_gradients()
        self.finish_gradient_sync()  # no hook fired during the schedule: reduce all of them now
        self.sync_sequence_parallel(module, accumulating)  # the schedule's run reduced them (pipeline/fsdp.py)

    # ------------------------------------------------------------------ clip
    @property
    def clips_globally(self) -> bool:
        """Lightning's clipping sees only this rank's pieces under tp, pp or ep; ours takes the global norm."""
        return self.tp is not None or self.pp is not None or self.ep is not None

    def index_clipping(self, module: nn.Module, precision: FiveDPrecision | None) -> None:
        """Which of the parameters the optimizers see (ZeRO and fp32 master slices included) are tp
        shards or experts: their norms sum over tp / the ep group."""
        names = {id(p): n for n, p in module.named_parameters()}
        if self.zero is not None:
            names.update(self.zero.master_names())
        if precision is not None:
            names.update(precision.master_names(module))
        self._tp_sharded = {i for i, n in names.items() if self.tp is not None and self.tp.is_sharded(n)}
        self._experts = {i for i, n in names.items() if self.ep is not None and self.ep.is_expert(n)}

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded, experts = self._tp_sharded, self._experts
        clip_grad_norm_(
            params,
            float(clip_val),
            lambda p: id(p) in sharded,
            self.tp.group if self.tp is not None else None,
            stage_group=self.pp.group if self.pp is not None else None,
            is_expert=lambda p: id(p) in experts,
            expert_group=self.ep.group if self.ep is not None else None,
        )


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
        ctx.plan = discover(ctx.module, ctx.config.model_plan)
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
    when no rank shares this one's data shard."""

    name = "data"

    def check(self, ctx: ApplyContext) -> None:
        why = hsdp_zero3_cp(ctx.combination)
        if why is not None:
            raise ModelMappingError(why)

    def apply(self, ctx: ApplyContext) -> None:
        if ctx.config.zero == ZeroStage.PARAMETERS:
            self._fsdp(ctx)
            return
        ctx.materialize()  # ZeRO-0..2 engines take the real parameters
        if ctx.layout.ep > 1 or ctx.mesh.size("dp_cp") > 1:
            ctx.applied.zero = ZeroSet(self._engines(ctx))
        # else: no data-parallel peers, nothing to reduce or shard: plain single-rank training.

    def _fsdp(self, ctx: ApplyContext) -> None:
        applied, precision, module, ep = ctx.applied, ctx.precision, ctx.module, ctx.layout.ep
        _, blocks = find_blocks(module)
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
    ctx.plan_needed = any(step.needs_plan(ctx) and step.wanted(ctx) for step in steps)
    active = [step for step in steps if step.wanted(ctx)]
    for step in active:
        step.check(ctx)
    for step in active:
        step.apply(ctx)
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


def _through_forward(module: nn.Module, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` called from inside the LightningModule's ``__call__`` (Lightning's forward
    redirection), for a module that is itself the outermost ZeRO-3 unit: FSDP2 gathers the
    parameters it holds directly (embedding, norm, head) in its forward hooks."""

    def run(*args: Any, **kwargs: Any) -> Any:
        own = vars(module).get("forward")  # an instance-level forward, if the module had one

        def restore() -> None:
            if own is None:
                vars(module).pop("forward", None)
            else:
                module.forward = own

        def forward(*a: Any, **k: Any) -> Any:
            restore()  # the step's own self(...) calls reach the real forward
            return step(*a, **k)

        module.forward = forward
        try:
            return module(*args, **kwargs)
        finally:
            restore()

    return run
