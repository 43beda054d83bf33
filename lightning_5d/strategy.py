"""``FiveDStrategy``: Lightning lifecycle glue. Every real job is delegated: argument checks to
``strategy_args`` (over ``config``), ranks and groups to ``mesh``, the dimensions to ``dimensions``
(their order) and ``applied`` (their part in each step), checkpoints to ``checkpoint.strategy_hooks``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Mapping

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_5d.applied import AppliedDimensions
from lightning_5d.auto_layout import planned_config
from lightning_5d.checkpoint.strategy_hooks import CheckpointHooks
from lightning_5d.checkpoint.options import CheckpointFormat, CheckpointWrite
from lightning_5d.config import ActivationCheckpointing, Layout, LayoutError, ParallelConfig, VerifyMode, ZeroStage
from lightning_5d.dimensions import apply_dimensions, combination_for
from lightning_5d.fp8.numerics_check import log_numerics, loss_without_fp8, numerics_check_due
from lightning_5d.gradient_places import GradientPlaces
from lightning_5d.materialize import InitLog, MetaBuild
from lightning_5d.mesh import ParallelMesh
from lightning_5d.metric_sync import metrics_of, sync_metrics_across_tp
from lightning_5d.parallel.context import ContextParallel
from lightning_5d.parallel.expert import ExpertParallel
from lightning_5d.parallel.frozen import refuse_finetuning_callbacks
from lightning_5d.parallel.pipeline import PipelineMode, PipelineParallel
from lightning_5d.parallel.step_log import shadowed
from lightning_5d.parallel.tensor.plain import plain_tensors
from lightning_5d.parameter_reads import refuse_averaging_callbacks
from lightning_5d.piece_reads import unwatched
from lightning_5d.precision import FiveDPrecision
from lightning_5d.process_exit import leave_together_at_exit, mark_failed
from lightning_5d.strategy_args import strategy_args


class FiveDStrategy(CheckpointHooks, ParallelStrategy):
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
        verify: str | VerifyMode = VerifyMode.AUTO,
        *,
        config: ParallelConfig | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Checked and normalised before any state is set: a bad value raises LayoutError naming the field.
        args = strategy_args(
            config,
            layout=dict(
                dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, ep=ep, zero=zero,
                activation_checkpointing=activation_checkpointing, sequence_parallel=sequence_parallel,
                model_plan=model_plan, rank_order=rank_order, bucket_size_mb=bucket_size_mb, pipeline=pipeline,
                context=context, expert=expert, verify=verify,
            ),
            options=dict(
                checkpoint_format=checkpoint_format, checkpoint_write=checkpoint_write, keep_last_k=keep_last_k,
                pretrained=pretrained, pretrained_prefix=pretrained_prefix,
                process_group_backend=process_group_backend, timeout=timeout,
            ),
        )  # fmt: skip
        self.config, self._plan_layout = args.config, args.plan_layout
        self._process_group_backend, self._timeout = args.options.process_group_backend, args.options.timeout
        self._take_checkpoint_options(args.options)
        self._layout: Layout | None = None
        self._mesh: ParallelMesh | None = None
        self._applied = AppliedDimensions()  # what lightning_5d.dimensions built, once setup ran
        self._in_backward_sync_block = False
        # Models built on the meta device: what their construction recorded, materialized per shard.
        self._meta = MetaBuild(InitLog())
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
    def dimensions(self) -> AppliedDimensions:
        """What the dimensions built for the module (empty before setup)."""
        return self._applied

    @property
    def pipeline(self) -> PipelineParallel | None:
        """This rank's pipeline stages and the timings of the last pipeline run (``None`` when pp=1)."""
        return self._applied.pp

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The MoE dispatch under ep > 1 (its ``last_plans`` hold the all-to-all splits), else None."""
        return self._applied.ep

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The sequence routing under cp > 1 (its ``stats`` count ring-attention work), else None."""
        return self._applied.cp

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
            # A model built in configure_model does not exist yet: build it on meta now (Lightning's
            # own call later finds it built), so the planner counts its parameters, not zero.
            self._meta.build_now(self.lightning_module, self.tensor_init_context)
            # Rank 0 decides for everyone: ranks on hosts with different memory could disagree.
            planned = None
            if self.global_rank == 0:
                planned = planned_config(
                    self.config, self.lightning_module, world_size, precision=self.precision_plugin.precision,
                    device=self.root_device, local_processes=self.num_processes,
                )  # fmt: skip
            self.config = self.broadcast(planned)
            self._layout = self.config.resolve(world_size)
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:  # before the callbacks' setup copies the whole module
            refuse_averaging_callbacks(trainer.callbacks, self._layout, int(self.config.zero))
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
        self._meta.capture(self.lightning_module)  # before any conversion renames or recasts a meta tensor
        self.model = self.precision_plugin.convert_module(self.model)
        self._meta.to_device(self.model, self.root_device) if self._meta.active else self.model_to_device()
        self._parallelize(self.lightning_module)
        self._load_pretrained()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._applied.check_units_sharded()
            self.setup_optimizers(trainer)
            if self._applied.zero is not None:
                for optimizer in self.optimizers:
                    self._applied.zero.shard_optimizer(optimizer)
            if precision is not None:  # bf16 parameters the optimizers still hold get fp32 masters
                automatic = self.lightning_module.automatic_optimization
                precision.attach_masters(self.optimizers, automatic, int(self.zero_stage))
                self._applied.watch_masters(self.lightning_module, precision)
            refuse_finetuning_callbacks(trainer.callbacks, self.optimizers, self.lightning_module, int(self.zero_stage))
        self.setup_precision_plugin()
        if self._applied.clips_globally:
            self._applied.index_clipping(self.lightning_module, precision)
            self.precision_plugin.clip_grad_by_norm = self._applied.clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            module = self.lightning_module
            places = GradientPlaces(module, self._applied, precision, int(self.zero_stage))
            self._applied.watch_gradient_reads(module, trainer.callbacks, places)
            self._applied.watch_parameter_reads(module)

    def _parallelize(self, module: torch.nn.Module) -> None:
        """The dimensions in their fixed order (``lightning_5d.dimensions.STEPS``), once per module."""
        if self._applied.already_applied(module):
            return  # fit after validate: the same module keeps its dimensions
        if self._adopt_earlier_dimensions(module):
            return
        precision = self._five_d_precision
        combination = combination_for(self.config, self.layout, precision, self._grad_scaler is not None)
        self._applied = apply_dimensions(
            module, self.config, self.mesh, precision, combination, meta=self._meta, device=self.root_device
        )
        self._applied.leave_on(module, self.config, self.layout)
        self._applied.metrics = metrics_of(module)  # found once: the step's tp edges use them
        sync_metrics_across_tp(self._applied.metrics, self.mesh)

    def _adopt_earlier_dimensions(self, module: torch.nn.Module) -> bool:
        """A module an earlier Trainer's FiveDStrategy already cut (a second fit with a new Trainer,
        as staged fine-tuning does) keeps those dimensions; they cannot be applied twice. Before
        this, applying them again re-discovered the cut model (tp: a wrong "give the right head
        counts" refusal), broadcast FSDP2's DTensors (ZeRO-3) or lost a pipeline peer (pp)."""
        earlier = AppliedDimensions.left_on(module)
        if earlier is None or not earlier.applied.cuts_module:
            return False
        if earlier.config != self.config or earlier.layout != self.layout:
            raise LayoutError(
                f"this module was already parallelized by an earlier FiveDStrategy ({earlier.layout.describe()}, "
                f"zero={int(earlier.config.zero)}), and a module's dimensions are applied once; this strategy asks "
                f"for {self.layout.describe()}, zero={int(self.config.zero)} (or other settings). Use the same "
                f"FiveDStrategy settings for the next Trainer, or build a new module and load the checkpoint into it "
                f"(a sharded checkpoint loads under any layout)."
            )
        self._applied = earlier.applied
        self._applied.already_applied(module)  # wakes the ZeRO engines, as a second fit with one Trainer does
        return True

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init`` True or None (configure_model): build on the meta device and record the
        initialization; setup materializes each rank's pieces with a single process's values."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with self._meta.recording(), self.precision_plugin.tensor_init_context():
            yield

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
        # The flag marks the window even where gradients are still reduced (fp32 accumulation), so
        # SP's once-per-step sum over tp waits for its end.
        with self._applied.gradient_sync_paused(self._five_d_precision):
            self._in_backward_sync_block = True
            try:
                yield
            finally:
                self._in_backward_sync_block = False

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._applied.start_backward()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        self._applied.manual_window.close()  # the backward's own gradient reads are the strategy's
        with unwatched():  # from a manual step: the backward's reads of parameters are the layout's
            out = self._backward(closure_loss, optimizer, *args, **kwargs)
        if not self.lightning_module.automatic_optimization:
            self._applied.open_manual_window(self.lightning_module)  # the user's step clips by hand here
        return out

    def _backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._applied.pp is not None:
            return self._pipeline_backward(closure_loss)
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if self._applied.cp is not None and self.lightning_module.automatic_optimization:
                self._applied.cp.end()  # routing stayed on for activation-checkpoint recomputation

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._applied.finish_gradient_sync()
        if self._five_d_precision is not None:
            self._five_d_precision.after_backward(
                self.lightning_module.automatic_optimization, accumulating=self._in_backward_sync_block
            )
        self._applied.sync_sequence_parallel(self.lightning_module, self._in_backward_sync_block)

    # ------------------------------------------------------------------ steps
    def _pipeline_step(self, mode: PipelineMode, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return self._applied.pipeline_step(self.lightning_module, mode, step, args, kwargs, self.root_device)

    def _pipeline_backward(self, closure_loss: Tensor) -> Tensor:
        """The schedule already ran the backward: restore its gradients, fire the hooks, reduce."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._applied.pipeline_backward(module, self._in_backward_sync_block)
        return self.precision_plugin.post_backward(closure_loss, module)

    @property
    def _grad_scaler(self):
        return getattr(self.precision_plugin, "scaler", None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._applied.align_random_stream(self.lightning_module.trainer.global_step)
        # Manual optimization: the user's step closes the window opened by its manual_backward as it
        # returns, inside every context entered around it (the step regions, Lightning's
        # train_step_context), whose modes must leave torch's mode stack from its top.
        module = self.lightning_module
        manual = not module.automatic_optimization
        closing = shadowed(module, "training_step", self._closing_manual_window) if manual else nullcontext()
        with self._applied.expert_step(module), self._applied.watched_training_step(module), closing:
            return self._training_step(args, kwargs)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        self._applied.manual_window.close()
        with unwatched():  # from a manual step: the optimizer's reads of parameters are the layout's
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._applied.ep is not None:
            self._applied.ep.after_optimizer_step()  # aux-loss-free bias moves once per optimizer step
        return out

    def _training_step(self, args: tuple, kwargs: dict) -> Any:
        step = super().training_step
        if self._applied.pp is not None:
            return self._pipeline_step(PipelineMode.TRAIN, step, args, kwargs)
        # Automatic optimization runs backward after the step returns: the shard stays current
        # until then, for activation-checkpoint recomputation (see backward). Manual
        # optimization runs its backward(s) inside the step.
        module, precision = self.lightning_module, self._five_d_precision
        automatic = module.automatic_optimization
        reference = None
        if numerics_check_due(precision, module.trainer, automatic):
            # The check's forward runs first: under cp the real step's shard must stay active until its backward.
            check = lambda: self._applied.run_step(  # noqa: E731
                module, PipelineMode.TRAIN, step, args, kwargs, keep_shard=False
            )
            reference = loss_without_fp8(precision, module, check, self.root_device)
        out = self._applied.run_step(module, PipelineMode.TRAIN, step, args, kwargs, keep_shard=automatic)
        if reference is not None:
            log_numerics(precision, module, out, reference, warn=self.is_global_zero)
        return out

    def _closing_manual_window(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The user's ``training_step``, closing the manual-optimization window as it returns."""

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            finally:
                self._applied.manual_window.close()

        return run

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(super().test_step, args, kwargs)

    def _eval_step(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._applied.pp is not None:
            return self._pipeline_step(PipelineMode.EVAL, step, args, kwargs)
        return self._applied.run_step(self.lightning_module, PipelineMode.EVAL, step, args, kwargs, keep_shard=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._applied.check_predict()
        return self._eval_step(super().predict_step, args, kwargs)

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

    def parameter_grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Each parameter's gradient norm, as one process computes it, by name, on every rank
        (a collective: call it on every rank). ``lightning_5d.grad_norm`` formats it as Lightning's
        ``grad_norm``; it reads the gradients wherever the layout keeps them (tp shards, ZeRO
        slices, fp32 masters, other pipeline stages)."""
        return self._applied.grad_norms(self.lightning_module, float(norm_type), self.root_device)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Over the data ranks (``sync_dist``): a logged value differs only between them. Its tp, cp
        and pp peers hold the same value (the step's edges make it so), and a sum over the world
        would count it tp x cp x pp times (it did: 2x under tp2, 4x under pp2 x tp2)."""
        tensor = plain_tensors(tensor)  # c10d has no DTensor rule: a value derived from tp's logits
        if isinstance(tensor, Tensor):
            if group is None and self._mesh is not None:
                group = self._mesh.group("dp")
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Every rank votes (a stop one pp stage decides must stop its peers): over the world, not
        # the data ranks that ``reduce`` sums over.
        votes = _sync_ddp_if_available(torch.tensor(int(decision), device=self.root_device), None, reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(plain_tensors(tensor), group=group, sync_grads=sync_grads)

    @override
    def teardown(self) -> None:
        self._checkpoints.wait()
        self._applied.deactivate()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="lightning_5d: DP/ZeRO-0..3 + TP/SP + CP + PP + EP on one device mesh",
        )

