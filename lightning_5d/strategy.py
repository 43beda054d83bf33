"""``FiveDStrategy``: Lightning lifecycle glue. Every real job is delegated:
layout validation to ``config``, ranks and groups to ``mesh``, sharding to ``parallel``.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_5d.checkpoint.data_position import ResumableLoader
from lightning_5d.checkpoint.pretrained import PretrainedLoad, load_pretrained
from lightning_5d.checkpoint.strategy_io import CheckpointFormat, CheckpointWrite, StrategyCheckpoints
from lightning_5d.auto_layout import planned_config
from lightning_5d.config import (
    ActivationCheckpointing,
    Layout,
    LayoutError,
    LoadBalancing,
    ParallelConfig,
    PipelineSchedule,
    StrategyOptions,
    ZeroStage,
    ineffective_settings,
    validate_early,
)
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
from lightning_5d.parallel.data import DataGroups, ZeroDataParallel, broadcast_module
from lightning_5d.parallel.expert import ExpertParallel, ExpertParallelError
from lightning_5d.parallel.fsdp import apply_expert_fsdp, apply_fp8_gather_units, apply_fsdp, set_gradient_sync
from lightning_5d.parallel.grad_norm import clip_grad_norm_
from lightning_5d.parallel.pipeline import PipelineMode, PipelineParallel
from lightning_5d.parallel.pipeline_batch import PipelineError
from lightning_5d.parallel.pipeline_fsdp import adopt_stage_units
from lightning_5d.parallel.pipeline_loop import PipelineLoop, check_pipeline_supported
from lightning_5d.parallel.tensor import TensorParallel
from lightning_5d.parallel.vocab import loss_parallel_region
from lightning_5d.parallel.zero_set import ZeroSet
from lightning_5d.plan import describe, discover
from lightning_5d.process_exit import leave_together_at_exit, mark_failed
from lightning_5d.plan.blocks import ModelMappingError, find_blocks, require_blocks
from lightning_5d.precision import FiveDPrecision, PrecisionError


def _sizes_text(config: ParallelConfig) -> str:
    return ", ".join(f"{d}={getattr(config, d)}" for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"))


class FiveDStrategy(ParallelStrategy):
    """Data (ZeRO-0..3, HSDP), tensor, context, pipeline and expert parallelism on one mesh.

    Sizes are keyword arguments (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep``);
    ``dp_shard="auto"`` (the default) absorbs whatever the other sizes leave of the world.
    With no size and no ``zero`` given, the planner picks the layout for the model and world
    at setup (``lightning_5d.estimate.choose_layout``).
    """

    strategy_name = "5d"

    def __init__(
        self,
        dp_replicate: int | str | None = None,
        dp_shard: int | str | None = None,
        cp: int | str | None = None,
        tp: int | str | None = None,
        pp: int | str | None = None,
        ep: int | str | None = None,
        zero: int | ZeroStage | None = None,
        activation_checkpointing: str | ActivationCheckpointing = ActivationCheckpointing.NONE,
        sequence_parallel: bool = False,
        model_plan: Mapping[str, str] | None = None,
        rank_order: tuple[str, ...] | None = None,
        bucket_size_mb: float = 25.0,
        pipeline: Mapping[str, Any] | None = None,
        context: Mapping[str, Any] | None = None,
        expert: Mapping[str, Any] | None = None,
        checkpoint_format: str | CheckpointFormat = CheckpointFormat.SHARDED,
        checkpoint_write: str | CheckpointWrite = CheckpointWrite.SYNC,
        keep_last_k: int | None = None,
        pretrained: str | os.PathLike | None = None,
        pretrained_prefix: str | None = None,
        *,
        config: ParallelConfig | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Every argument's type and range is declared in lightning_5d.config (ParallelConfig,
        # StrategyOptions); both raise LayoutError naming the field and its allowed values.
        options = StrategyOptions(
            checkpoint_format=checkpoint_format,
            checkpoint_write=checkpoint_write,
            keep_last_k=keep_last_k,
            pretrained=pretrained,
            pretrained_prefix=pretrained_prefix,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
        given = {k: v for k, v in {**sizes, "zero": zero}.items() if v is not None}
        # No size and no ZeRO stage given (as with the string "5d"): the planner decides at setup.
        self._plan_layout = config is None and not given
        if config is None:
            sections = {"pipeline": pipeline, "context": context, "expert": expert}
            config = ParallelConfig(
                **given,
                activation_checkpointing=activation_checkpointing,
                sequence_parallel=sequence_parallel,
                model_plan=model_plan,
                bucket_size_mb=bucket_size_mb,
                **({"rank_order": rank_order} if rank_order is not None else {}),
                **{k: v for k, v in sections.items() if v is not None},
            )
        elif not isinstance(config, ParallelConfig):
            raise LayoutError(f"config={config!r} is not valid; allowed: a ParallelConfig, or None.")
        validate_early(config)
        if not self._plan_layout:  # a planned layout's sizes are not known yet
            ineffective = ineffective_settings(config)
            if ineffective:
                rank_zero_warn(
                    f"FiveDStrategy: these settings have no effect under the layout {_sizes_text(config)}: "
                    + "; ".join(ineffective),
                    category=UserWarning,
                )
        self.config = config
        self._process_group_backend = options.process_group_backend
        self._timeout = options.timeout
        self._layout: Layout | None = None
        self._mesh: ParallelMesh | None = None
        self._zero: ZeroSet | None = None
        self._fsdp_units: list = []
        self._tp: TensorParallel | None = None
        self._tp_sharded_ids: set[int] = set()
        self._expert_ids: set[int] = set()
        self._cp: ContextParallel | None = None
        self._pp: PipelineParallel | None = None
        self._pp_loop: PipelineLoop | None = None
        self._ep: ExpertParallel | None = None
        self._in_backward_sync_block = False
        self._parallelized: torch.nn.Module | None = None
        self._checkpoints = StrategyCheckpoints(
            self, options.checkpoint_format, options.checkpoint_write, options.keep_last_k
        )
        # Weights to start from (a plain or Hugging Face state dict), read once after parallelizing.
        self._pretrained = (options.pretrained, options.pretrained_prefix) if options.pretrained is not None else None
        self.pretrained_load: PretrainedLoad | None = None  # what was loaded: names, prefix, groups
        self.num_nodes = 1

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # precision='bf16-mixed' means Megatron's bf16 mixed here (bf16 weights, fp32 masters):
        # Lightning's autocast over fp32 weights would hold 4 + 4 bytes where the planner counts 2 + 2.
        if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
            plugin = FiveDPrecision("bf16-mixed")
        if isinstance(plugin, FiveDPrecision):
            plugin.attached = True
        self._precision_plugin = plugin

    @property
    def _five_d_precision(self) -> FiveDPrecision | None:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, FiveDPrecision) else None

    @classmethod
    def from_config(cls, config: ParallelConfig | Mapping[str, Any], **kwargs: Any) -> "FiveDStrategy":
        if not isinstance(config, ParallelConfig):
            config = ParallelConfig.from_mapping(config)
        return cls(config=config, **kwargs)

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("the layout is resolved in setup_environment(), once the world size is known.")
        return self._layout

    @property
    def mesh(self) -> ParallelMesh:
        if self._mesh is None:
            raise RuntimeError("the device mesh exists only after the process group has started.")
        return self._mesh

    @property
    def pipeline(self) -> PipelineParallel | None:
        """This rank's pipeline stages and the timings of the last pipeline run (``None`` when pp=1)."""
        return self._pp

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The MoE dispatch under ep > 1 (its ``last_plans`` hold the all-to-all splits), else None."""
        return self._ep

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The sequence routing under cp > 1 (its ``stats`` count ring-attention work), else None."""
        return self._cp

    @property
    def zero_stage(self) -> ZeroStage:
        return self.config.zero

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning injects its DistributedSampler only for strategies that say so.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # tp/cp/pp peers must read the same samples: replicas are the data ranks only.
        return {"num_replicas": self.mesh.data_size, "rank": self.mesh.data_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer states only exist in their sharded form after setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True  # through load_optimizer_state_dict below, after setup sharded them

    @override
    def _configure_launcher(self) -> None:
        # The Trainer knows devices x nodes here, before any process is launched: a layout
        # that cannot work fails at `Trainer(...)`, not minutes later on every rank.
        self._layout = self.config.resolve(self.num_nodes * self.num_processes)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup_environment(self) -> None:
        world_size = self.num_nodes * self.num_processes
        # An explicit layout was validated in _configure_launcher, before any process started.
        self._layout = self.config.resolve(world_size)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        if self._plan_layout:
            # Rank 0 decides for everyone: ranks on hosts with different memory could disagree.
            self.config = self.broadcast(
                planned_config(
                    self.config,
                    self.lightning_module,
                    world_size,
                    precision=self.precision_plugin.precision,
                    device=self.root_device,
                    local_processes=self.num_processes,
                )
                if self.global_rank == 0
                else None
            )
            self._layout = self.config.resolve(world_size)
        if self._mesh is None or self._mesh.layout != self._layout:
            self._mesh = ParallelMesh(self._layout, self.root_device.type)
        leave_together_at_exit()
        rank_zero_info(f"[lightning_5d] layout: {self._layout.describe()}, zero={int(self.config.zero)}")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        precision = self._five_d_precision
        if precision is not None:
            precision.device_type = self.root_device.type
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize(self.lightning_module)
        if self._pretrained is not None:
            # Each rank reads only its own pieces; a ckpt_path given to fit is restored after
            # setup and so still wins over these weights.
            path, prefix = self._pretrained
            self.pretrained_load = load_pretrained(self, path, prefix=prefix)
            self._pretrained = None  # a later fit/validate on this Trainer keeps the trained weights
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._zero is not None:
                for optimizer in self.optimizers:
                    self._zero.shard_optimizer(optimizer)
            if precision is not None:  # bf16 parameters the optimizer still holds get fp32 masters
                precision.reset_masters()  # a later fit's new optimizers replace the earlier ones
                for optimizer in self.optimizers:
                    precision.add_master_weights(optimizer)
                self._check_manual_optimizers(precision)
        self.setup_precision_plugin()
        if self._tp is not None or self._pp is not None or self._ep is not None:
            # Lightning's clipping sees only this rank's pieces; ours takes the global norm.
            self._tp_sharded_ids = self._sharded_param_ids(self._tp.is_sharded) if self._tp is not None else set()
            self._expert_ids = self._sharded_param_ids(self._ep.is_expert) if self._ep is not None else set()
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: torch.nn.Module) -> None:
        """The fixed order of the design: ... -> activation checkpointing -> ZeRO/FSDP."""
        if self._zero is not None:
            self._zero.active = True  # fit after validate: same module, same engine
            return
        if self._pp is not None:
            if self._pp.module is not module:
                raise PipelineError(
                    "this FiveDStrategy already cut another module into pipeline stages; use a new Trainer "
                    "(and strategy) for a different module."
                )
            return
        if self._fsdp_units:
            return
        if self._parallelized is module:
            return  # fit after validate without data-parallel peers: the dims are applied already
        self._parallelized = module
        precision = self._five_d_precision
        fp8 = precision is not None and precision.fp8 is not None
        if precision is not None and self.config.zero != ZeroStage.PARAMETERS:
            precision.cast_parameters(module)  # ZeRO-3 keeps fp32 shards: FSDP2 casts per all-gather
        broadcast_module(module, self.mesh)
        tp, cp, pp, ep = self.mesh.size("tp"), self.mesh.size("cp"), self.mesh.size("pp"), self.layout.ep
        combination = self._combination(precision)
        if precision is not None:
            self._check_precision_supported(precision, combination)
        if pp > 1:
            check_pipeline_supported(module, combination)
        for rule, error in ((ep_sequence_parallel, ExpertParallelError), (hsdp_zero3_cp, ModelMappingError)):
            why = rule(combination)  # refused before any dimension changes the module
            if why is not None:
                raise error(why)
        # Capacity and load balancing need our dispatch even when every expert is local.
        experts_wanted = ep > 1 or self.config.expert.wants_dispatch
        wanted = max(tp, cp, pp) > 1 or experts_wanted or fp8
        plan = discover(module, self.config.model_plan) if wanted else None
        if plan is not None:
            rank_zero_info(f"[lightning_5d] model plan:\n{describe(plan)}")
        if fp8:
            ac = self.config.activation_checkpointing != ActivationCheckpointing.NONE
            layout = {"tp": tp, "pp": pp, "ep": ep}
            precision.apply_fp8(module, plan, layout, ac, self.mesh.group("dp_cp"), experts=experts_wanted)
        if precision is not None:
            rank_zero_info(f"[lightning_5d] precision: {precision.describe()}")
        if tp > 1:
            self._tp = TensorParallel(module, plan, self.mesh["tp"], self.config.sequence_parallel)
            if self.config.sequence_parallel and self.config.zero != ZeroStage.PARAMETERS:
                self._tp.register_sequence_parallel_grad_hooks(module)
        if experts_wanted:
            self._check_experts_supported()
            self._ep = ExpertParallel(module, plan, self.mesh, self.config.expert)
        if cp > 1:
            self._cp = ContextParallel(module, plan, self.mesh["cp"], self.config.context,
                                       hybrid_groups=self.mesh.context_groups, tp=tp)  # fmt: skip
            rank_zero_info(f"[lightning_5d] context parallel: {self._cp.describe()}")
        if self.config.activation_checkpointing != ActivationCheckpointing.NONE:
            _, blocks = require_blocks(module, f"activation_checkpointing={self.config.activation_checkpointing.value}")
            apply_activation_checkpointing(blocks, self.config.activation_checkpointing)
        if pp > 1:
            self._pp = PipelineParallel(module, plan, self.mesh, self.config.pipeline)
            self._pp_loop = PipelineLoop(self._pp, self.config.pipeline.log_bubble)
            if self._ep is not None:
                self._ep.drop_absent(module)
            rank_zero_info(f"[lightning_5d] pipeline: {self._pp.describe()}")
        if self.config.zero == ZeroStage.PARAMETERS:
            _, blocks = find_blocks(module)
            policy = precision.fsdp_policy() if precision is not None else None
            inner = apply_expert_fsdp(self._ep, self.mesh, policy) if ep > 1 else []
            if fp8 and precision.fp8.fp8_all_gather:
                # Experts under ep > 1 are their own units on another mesh: they gather in bf16.
                dense = [n for n in precision.fp8_names if ep == 1 or not self._ep.is_expert(f"{n}.weight")]
                names = precision.enable_fp8_all_gather(module, dense)
                linears = [module.get_submodule(n) for n in names]
                inner = inner + apply_fp8_gather_units(linears, self.mesh, precision.reduce_dtype)
            root_holds_blocks = self._pp is not None
            units = apply_fsdp(module, blocks, self.mesh, policy, inner, root_holds_blocks=root_holds_blocks)
            self._fsdp_units = inner + units
            if self._pp is not None:
                adopt_stage_units(self._fsdp_units)
                self._pp.divide_loss_by_microbatches = True
        elif ep > 1:
            # Expert gradients reduce over the ranks holding the same experts, the rest over dp x cp.
            is_expert, stage, mb = self._ep.is_expert, self.config.zero, self.config.bucket_size_mb
            rd = precision.reduce_dtype if precision is not None else None
            fp32_acc = precision is not None and precision.fp32_accumulation
            experts = DataGroups.experts(self.mesh)
            self._zero = ZeroSet(
                [
                    ZeroDataParallel(
                        module,
                        self.mesh,
                        stage,
                        mb,
                        rd,
                        owns=lambda n: not is_expert(n),
                        accumulate_in_masters=fp32_acc,
                    ),
                    ZeroDataParallel(
                        module, self.mesh, stage, mb, rd, groups=experts, owns=is_expert, accumulate_in_masters=fp32_acc
                    ),
                ]
            )
        elif self.mesh.size("dp_cp") > 1:
            engine = ZeroDataParallel(
                module,
                self.mesh,
                self.config.zero,
                self.config.bucket_size_mb,
                reduce_dtype=precision.reduce_dtype if precision is not None else None,
                accumulate_in_masters=precision is not None and precision.fp32_accumulation,
            )
            self._zero = ZeroSet([engine])
        # else: no data-parallel peers, nothing to reduce or shard: plain single-rank training.

    @override
    def setup_optimizers(self, trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient reduction on micro-batches that only accumulate."""
        precision = self._five_d_precision
        if precision is not None and precision.fp32_accumulation:
            # Every micro-batch is reduced and summed in fp32 (ZeRO-3: in FSDP2's fp32 shards); the
            # flag still marks the window, so SP's once-per-step sum over tp waits for its end.
            self._in_backward_sync_block = True
            try:
                yield
            finally:
                self._in_backward_sync_block = False
            return
        if self._zero is not None:
            self._zero.require_sync = False
        set_gradient_sync(self._fsdp_units, False)
        self._in_backward_sync_block = True
        try:
            yield
        finally:
            if self._zero is not None:
                self._zero.require_sync = True
            set_gradient_sync(self._fsdp_units, True)
            self._in_backward_sync_block = False

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._zero is not None:
            self._zero.start_backward()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pp is not None:
            return self._pipeline_backward(closure_loss)
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if self._cp is not None and self.lightning_module.automatic_optimization:
                self._cp.end()  # routing stayed on for activation-checkpoint recomputation

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._zero is not None:
            self._zero.finish_gradient_sync()
        if self._five_d_precision is not None:
            self._five_d_precision.after_backward(
                self.lightning_module.automatic_optimization, accumulating=self._in_backward_sync_block
            )
        self._sync_sequence_parallel_under_fsdp()

    def _sync_sequence_parallel_under_fsdp(self) -> None:
        if self._tp is not None and self._fsdp_units and self._tp.sequence_parallel:
            if not self._in_backward_sync_block:  # FSDP2 reduced this step's gradients
                self._tp.sync_sequence_parallel_grads(self.lightning_module)

    # ------------------------------------------------------------------ steps
    @contextmanager
    def _step_region(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            if self._tp is not None:  # the user's F.cross_entropy on vocab-sharded logits
                stack.enter_context(loss_parallel_region())
            if self._cp is not None:  # inside TP's: sees F.cross_entropy first, makes it sequence-global
                stack.enter_context(self._cp.step_region(self.lightning_module))
            yield

    def _run_step(self, step: Callable[..., Any], args: tuple, kwargs: dict, keep_shard: bool = False) -> Any:
        if self._cp is not None and args:
            args = (self._cp.begin(args[0]), *args[1:])
        try:
            with self._step_region():
                out = step(*args, **kwargs)
        except BaseException:
            if self._cp is not None:
                self._cp.end()
            raise
        if self._cp is not None and not keep_shard:
            self._cp.end()
        return out

    def _pipeline_step(self, mode: PipelineMode, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One Lightning batch as one pipeline run; the user's step runs per microbatch on each stage."""
        assert self._pp_loop is not None
        batch, rest = args[0], args[1:]
        return self._pp_loop.run(
            mode,
            lambda mb: step(mb, *rest, **kwargs),
            batch,
            zero=self._zero,
            fsdp_units=self._fsdp_units,
            cp=self._cp,
            step_region=self._step_region,
            device=self.root_device,
        )

    def _pipeline_backward(self, closure_loss: Tensor) -> Tensor:
        """The schedule already ran the backward: restore its gradients, fire the hooks, reduce."""
        assert self._pp_loop is not None
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._zero is not None:
            self._zero.start_backward()  # as before any backward: it may clear the module's gradients
        self._pp_loop.restore_gradients()
        if self._zero is not None:
            self._zero.finish_gradient_sync()  # no hook fired during the schedule: reduce all of them now
        self._sync_sequence_parallel_under_fsdp()  # the schedule's run reduced them (pipeline_fsdp.py)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _check_manual_optimizers(self, precision: FiveDPrecision) -> None:
        held = [o for o in self.optimizers if precision.masters_of(o) is not None]
        if len(self.optimizers) > 1 and held and not self.lightning_module.automatic_optimization:
            raise PrecisionError(
                f"manual optimization with {len(self.optimizers)} optimizers under bf16 mixed precision at "
                f"zero={int(self.config.zero)}: toggle_optimizer switches requires_grad on the fp32 masters, not "
                f"on the bf16 parameters the model computes with, so one optimizer's backward would leave "
                f"gradients for the other. Use zero=1, 2 or 3 (their masters are the sharded parameters), or "
                f"precision='32-true'."
            )

    def _combination(self, precision: FiveDPrecision | None) -> Combination:
        """The resolved layout and the options ``layout_rules`` reads (shared with the planner)."""
        pipe = self.config.pipeline
        return Combination(
            self.layout,
            zero=self.config.zero,
            sequence_parallel=self.config.sequence_parallel,
            schedule=PipelineSchedule(pipe.schedule),
            virtual_stages=pipe.virtual_stages,
            microbatches=pipe.microbatches,
            fp32_accumulation=precision is not None and precision.fp32_accumulation,
            loss_scaling=self._grad_scaler is not None,
            fp8_all_gather=precision is not None and precision.fp8 is not None and precision.fp8.fp8_all_gather,
        )

    def _check_precision_supported(self, precision: FiveDPrecision, combination: Combination) -> None:
        why = fp32_accumulation_pp(combination) or fp8_all_gather_zero(combination)
        if why is not None:
            raise PrecisionError(why)
        pp, ep = combination.layout.pp, combination.layout.ep
        experts = ep > 1 or self.config.expert.wants_dispatch
        if precision.guard.every and (pp > 1 or experts):
            raise PrecisionError(
                f"numerics_check_every={precision.guard.every} with pp={pp}, ep={ep}: the check runs the step's "
                f"forward a second time, which a pipeline schedule does not allow and which would count the "
                f"expert load twice; set numerics_check_every=0 there, or check on a pp=1 layout without "
                f"expert dispatch."
            )

    def _check_experts_supported(self) -> None:
        if self.config.expert.load_balancing == LoadBalancing.AUX_LOSS and self._grad_scaler is not None:
            raise ExpertParallelError(
                "expert.load_balancing=aux_loss with precision='16-mixed': the GradScaler scales the user's loss but "
                "not the aux term, which would then count 1/scale as much. Use precision='bf16-mixed' or '32-true', "
                "or load_balancing=bias."
            )

    @property
    def _grad_scaler(self):
        return getattr(self.precision_plugin, "scaler", None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._ep is None:
            return self._training_step(args, kwargs)
        # The aux loss enters the gradient as the user's loss does: after Lightning's 1/accumulate.
        self._ep.aux_scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        self._ep.start_step()
        out = self._training_step(args, kwargs)
        self._ep.after_step(self.lightning_module)
        return out

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._ep is not None:
            self._ep.after_optimizer_step()  # aux-loss-free bias moves once per optimizer step
        return out

    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        if self._pp is not None:
            return self._pipeline_step(PipelineMode.TRAIN, super().training_step, args, kwargs)
        # Automatic optimization runs backward after the step returns: the shard stays current
        # until then, for activation-checkpoint recomputation (see backward). Manual
        # optimization runs its backward(s) inside the step.
        automatic = self.lightning_module.automatic_optimization
        precision = self._five_d_precision
        trainer = self.lightning_module.trainer
        guard = precision is not None and precision.fp8 is not None and automatic
        guard = guard and precision.guard.due(trainer.global_step) and _first_micro_batch(trainer)
        # The check's forward runs first: under cp the real step's shard must stay active until its backward.
        reference = self._forward_without_fp8(args, kwargs) if guard else None
        out = self._run_step(super().training_step, args, kwargs, keep_shard=automatic)
        if reference is not None:
            self._compare_with_bf16(out, reference)
        return out

    def _forward_without_fp8(self, args: tuple, kwargs: dict) -> float | None:
        precision, module = self._five_d_precision, self.lightning_module
        assert precision is not None
        quiet = lambda *a, **k: None  # noqa: E731  (the check must not log the user's metrics twice)
        module.log, module.log_dict = quiet, quiet
        devices = [self.root_device] if self.root_device.type == "cuda" else []
        try:
            # The same random state as the real step: dropout masks match, and training's stream is untouched.
            with torch.random.fork_rng(devices=devices), torch.no_grad(), precision.fp8_off():
                out = self._run_step(super().training_step, args, kwargs)
        finally:
            del module.log, module.log_dict
        loss = _step_loss(out)
        return None if loss is None else float(loss)

    def _compare_with_bf16(self, out: Any, reference: float) -> None:
        loss = _step_loss(out)
        if loss is None:
            return
        precision = self._five_d_precision
        assert precision is not None
        rel = precision.check_numerics(float(loss.detach()), reference, warn=self.is_global_zero)
        self.lightning_module.log("fp8/loss_rel_diff", rel, sync_dist=True, on_step=True, on_epoch=False)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp is not None:
            return self._pipeline_step(PipelineMode.EVAL, super().validation_step, args, kwargs)
        return self._run_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp is not None:
            return self._pipeline_step(PipelineMode.EVAL, super().test_step, args, kwargs)
        return self._run_step(super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._cp is not None:
            raise ContextParallelError(
                f"predict under cp={self._cp.size} would return each rank's sequence shard; run predict with a "
                f"FiveDStrategy with cp=1 (checkpoints hold full tensors and load there unchanged)."
            )
        if self._ep is not None and self._ep.ep > 1:
            raise ExpertParallelError(
                f"predict under ep={self._ep.ep}: Lightning's predict sampler may give data ranks different numbers of "
                f"batches, and a rank that runs out would leave its ep peers waiting in the all-to-all. Run predict "
                f"with ep=1 (weights-only checkpoints hold every expert and load there unchanged)."
            )
        if self._pp is not None:
            return self._pipeline_step(PipelineMode.EVAL, super().predict_step, args, kwargs)
        return super().predict_step(*args, **kwargs)

    def _clip_grad_by_norm(self, optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded, experts = self._tp_sharded_ids, self._expert_ids
        clip_grad_norm_(
            params,
            float(clip_val),
            lambda p: id(p) in sharded,
            self._tp.group if self._tp is not None else None,
            stage_group=self._pp.group if self._pp is not None else None,
            is_expert=lambda p: id(p) in experts,
            expert_group=self._ep.group if self._ep is not None else None,
        )

    def _sharded_param_ids(self, matches: Callable[[str], bool]) -> set[int]:
        """ids of the parameters the optimizers see (ZeRO master slices included) whose name matches."""
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        if self._zero is not None:
            names.update(self._zero.master_names())
        if self._five_d_precision is not None:
            names.update(self._five_d_precision.master_names(self.lightning_module))
        return {i for i, name in names.items() if matches(name)}

    @override
    def on_exception(self, exception: BaseException) -> None:
        mark_failed()

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        self._checkpoints.wait()
        if self._zero is not None:
            self._zero.active = False  # hooks stay for a later fit/validate with this Trainer
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoints(self) -> StrategyCheckpoints:
        return self._checkpoints

    def full_model_state(self) -> dict[str, Any]:
        """Every tensor at its full shape, on every rank, whatever the layout (a collective)."""
        return self._checkpoints.full_model_state()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.model_state()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath) -> None:
        self._checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizers(checkpoint)

    @override
    def on_train_start(self) -> None:
        self._checkpoints.restore_rng()  # a resumed run's generators, now that the data is set up

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, _Stateful):
            return dataloader  # a loader that keeps its own position (StatefulDataLoader) needs no help
        return ResumableLoader(dataloader, trainer)

    def _keyed_by_model_params(self, optimizer):
        """fp32 masters stand in for bf16 parameters in the optimizer; checkpoints name the parameters."""
        precision = self._five_d_precision
        masters = precision.masters_of(optimizer) if precision is not None else None
        return masters.as_model_params() if masters is not None else nullcontext()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="lightning_5d: DP/ZeRO-0..3 + TP/SP + CP + PP + EP on one device mesh",
        )


def _step_loss(out: Any) -> Tensor | None:
    """The loss a training_step returned (a tensor, or a dict's "loss"), None if it returned none."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
        return out["loss"]
    return None


def _first_micro_batch(trainer) -> bool:
    """Whether this batch opens an optimizer step (the numerics check runs once per step)."""
    return (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % trainer.accumulate_grad_batches == 0
