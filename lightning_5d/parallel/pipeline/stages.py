"""Pipeline parallelism inside Lightning's loop, on an unchanged LightningModule.

How a stage runs the user's code: every pipeline rank reads the same batch (the sampler's
replicas are the data ranks), so each stage can run the user's own ``training_step`` on
its microbatch. On a stage that is not first, the embedding is a placeholder and the
received activation replaces the input of the stage's first block (a forward pre-hook,
after any TP hook, so the activation arrives in the layout the previous stage produced);
on a stage that is not last, a forward hook on its last block stops the step there and
hands that block's output to the pipeline. The last stage runs the step to the end: the
loss the user computes is what it backpropagates, and what the user logs is recorded,
averaged over the microbatches and logged on every rank. Everything between the
embedding and the first block (rotary tables, masks) runs on every stage from the same
batch, which is why nothing but the hidden state has to travel.

The schedules are ``torch.distributed.pipelining``'s (:mod:`.schedule`), with
static stage shapes taken from a probe of the first block's input.

Tied input/output embeddings (the head's weight *is* the embedding's): :mod:`.tied`.
Validation, test and predict run forward only (:mod:`.forward_only`); a training run in
which one rank's stage raises ends with every rank raising that error (:mod:`.failure`).

Microbatches and Lightning: one Lightning batch is one pipeline run of m microbatches
(``pipeline.microbatches``); gradients are the mean over them, the same as a step on the
whole batch when microbatches carry equal numbers of counted tokens.
``accumulate_grad_batches=k`` runs k pipeline runs per optimizer step.
"""

from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from lightning.fabric.utilities.apply_func import apply_to_collection

from lightning_5d.materialize.apply import placement_device
from lightning_5d.config import PipelineConfig, PipelineSchedule
from lightning_5d.parallel.regions import Region
from lightning_5d.parallel.step_log import log_options, log_through, shadowed
from lightning_5d.mesh import ParallelMesh
from lightning_5d.pipeline_shape import (
    check_schedule,
    check_stage_count,
    default_microbatches,
    local_stages,
    stage_ranks,
)
from lightning_5d.plan.model_plan import ModelPlan

from .cuttable import check_cuttable
from .batch import (
    PipelineError,
    _combine_logs,
    _loss_of,
    _shapes,
    _to_number,
    merge_step_outputs,
    split_microbatches,
)
from .stage import StageTimes, TimedStage
from .failure import StepFailures
from .forward_only import ForwardOnlyOutcome, ForwardOnlyRun, raise_failure
from .fsdp import reset_stopped_forward
from .schedule import schedule_class
from .split import split_blocks, stage_weights
from .tied import TiedEmbedding, check_tied_schedule, tied_names


class PipelineMode(str, Enum):
    TRAIN = "train"  # forward and backward
    EVAL = "eval"  # forward only (validation, test, predict)


class _StageBoundary(Exception):
    """Raised by the last block of a stage that is not last: carries its output out of the user's step."""

    def __init__(self, output: Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.output = output


class _Placeholder(nn.Module):
    """Stands in for a part that lives on another stage (embedding, head, ...).

    An embedding placeholder returns a zero tensor of the activation's shape, so the code
    between embedding and first block still runs; the real activation replaces it at the
    first block. A part that should never run here raises.
    """

    stands_in = True  # the plan verifier skips it: its real module runs on another stage

    def __init__(self, name: str, runtime: "PipelineParallel", produces_activation: bool) -> None:
        super().__init__()
        self.name = name
        self.produces_activation = produces_activation
        object.__setattr__(self, "_runtime", runtime)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self.produces_activation:
            raise PipelineError(
                f"{self.name} ran on pipeline stage {self._runtime.running_stage}, but it belongs to another "
                f"stage; the step must call it only after the model's blocks (final norm, head)."
            )
        return self._runtime.placeholder_activation(self.name)

    def __getattr__(self, attribute: str) -> Any:
        try:
            return super().__getattr__(attribute)
        except AttributeError:
            # An AttributeError still (hasattr() must stay False), saying why: a step reading the
            # embedding's weight on the last stage, where only a stand-in is.
            raise AttributeError(
                f"{self.name}.{attribute}: {self.name} is on another pipeline stage than this rank's (under pp each "
                f"rank holds its stages' blocks and parts; here {self.name} is a stand-in with no parameters). "
                f"Compute with it inside the model's forward, or put a penalty on its weights in the optimizer's "
                f"weight_decay."
            ) from None


class _StageModule(nn.Module):
    """What torch's PipelineStage runs: the stage's own parameters, and a forward that drives the user's step."""

    def __init__(
        self,
        runtime: "PipelineParallel",
        spec: "StageSpec",
        parts: dict[str, nn.Module],
        loose: dict[str, nn.Parameter] | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_runtime", runtime)
        self.spec = spec
        self.parts = nn.ModuleDict({k.replace(".", "__"): m for k, m in parts.items()})
        # Raw parameters the stage's part of the forward reads (learned positions on the model):
        # held here too, so torch's stage scales their gradients like the others'.
        self.loose = nn.ParameterDict({k.replace(".", "__"): p for k, p in (loose or {}).items()})

    def forward(self, x: Tensor) -> Tensor:
        return self._runtime.run_stage(self.spec, x)


@dataclass(frozen=True)
class StageSpec:
    index: int
    blocks: range
    is_first: bool
    is_last: bool


class PipelineParallel:
    """Cuts ``module`` into this rank's stages and runs Lightning steps as pipeline schedules."""

    def __init__(self, module: nn.Module, plan: ModelPlan, mesh: ParallelMesh, config: PipelineConfig) -> None:
        self.module = module
        self.plan = plan
        self.config = config
        self.schedule = PipelineSchedule(config.schedule)
        self.pp = mesh.size("pp")
        self.rank = mesh.local_rank("pp")
        self.group = mesh.group("pp")
        self.device = placement_device(module, mesh.root.device_type)  # real even for a meta-built model
        self.v = config.virtual_stages
        self.microbatches = config.microbatches or default_microbatches(self.pp, self.v)
        check_schedule(self.schedule, self.pp, self.v, self.microbatches)
        check_stage_count(plan.num_blocks, self.pp, self.v)
        first_loose, last_loose = check_cuttable(module, plan)
        params = dict(module.named_parameters())
        self._first_loose = {n: params[n] for n in first_loose}
        self._last_loose = {n: params[n] for n in last_loose}

        self.num_stages = self.pp * self.v
        self.owner = stage_ranks(self.schedule, self.pp, self.v)
        blocks = plan.blocks_of(module)
        head = module.get_submodule(plan.head) if plan.head else None
        weights = stage_weights(
            [sum(p.numel() for p in b.parameters()) for b in blocks],
            sum(p.numel() for p in head.parameters()) if head is not None else 0,
            config.balance,
        )
        self.ranges = split_blocks(weights, self.num_stages, config.stage_blocks)
        self.specs = [
            StageSpec(s, self.ranges[s], s == 0, s == self.num_stages - 1)
            for s in local_stages(self.schedule, self.pp, self.v, self.rank)
        ]
        self._container: nn.ModuleList = module.get_submodule(plan.blocks)
        self._all_blocks = dict(self._container._modules)
        self._real = {path: module.get_submodule(path) for path in self._part_paths()}
        self._first_params = {plan.embedding, *([plan.position_embedding] if plan.position_embedding else [])}
        self._last_params = {p for p in (plan.final_norm, plan.head) if p}
        names = tied_names(self._real[plan.embedding], self._real[plan.head])
        check_tied_schedule(names, self.schedule, plan)
        self.tied = TiedEmbedding(names, plan, self.owner, self.rank)
        self._placeholders = {path: self._placeholder(path) for path in self._part_paths()}
        self._stage_modules = {spec.index: self._make_stage_module(spec) for spec in self.specs}
        # Drop every reference to the other stages' parts: their memory goes once _rest() replaces them.
        owned = {str(i) for spec in self.specs for i in spec.blocks}
        self._all_blocks = {k: m for k, m in self._all_blocks.items() if k in owned}
        first, last = any(s.is_first for s in self.specs), any(s.is_last for s in self.specs)
        self._real = {
            path: m
            for path, m in self._real.items()
            if (path in self._first_params and first) or (path in self._last_params and last)
        }
        self.tied.hold_copy(self._real, self._placeholders, first, last)
        self._stand_in_loose(self._first_loose if not first else {})
        self._stand_in_loose(self._last_loose if not last else {})
        self._rest()
        self._first_block_arg = _first_argument_name(blocks[self.specs[0].blocks.start])
        del blocks
        self.tied.join_pair_group(mesh, self.group, self.pp)

        self.times = StageTimes()
        # A training run's first failure on this rank (its stages then stand in: _Stage).
        self.failures = StepFailures()
        # Checks before each training run whose verdict may differ by stage (parallel/frozen.py).
        self.checks_before_run: list[Callable[[], None]] = []
        self.current_microbatch: dict[int, int] = {}
        self.running_stage: int | None = None
        self._incoming: Tensor | None = None
        self._activation_meta: tuple[torch.Size, torch.dtype] | None = None
        # What the embedding parts output on the first stage: under sequence parallelism the
        # embedding's output is the whole sequence, the block input (what travels) one shard.
        self._part_meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._probed_for: tuple | None = None
        self._schedules: dict[tuple, Any] = {}
        self._mode = PipelineMode.TRAIN
        self._microbatches: list[Any] = []
        self._running = -1  # the microbatch whose step runs on this rank now (-1: none)
        self._weights: list[float] | None = None  # this run's microbatch weights for logged means (N_j)
        self._step_fn: Callable[[Any], Any] | None = None
        self._results: dict[int, Any] = {}
        self._logs: dict[int, list[tuple[str, Any, dict]]] = {}
        self.loss_scale = 1.0
        # FSDP units hold their gradients outside the parameters during the schedule, out of
        # reach of torch's division by m: the loss carries it instead (set by the strategy).
        self.divide_loss_by_microbatches = False

    @property
    def held_blocks(self) -> list[nn.Module]:
        """This rank's blocks (of every stage it runs) in model order: what ZeRO-3 makes units of.
        Read here, not found again in the cut model: a ``ModuleDict`` of blocks keeps its global
        keys on a stage ("1", "2", ...), which no longer read as a block list from "0"."""
        return list(self._all_blocks.values())  # the container's order, kept when the cut filtered it

    # ------------------------------------------------------------------ placement
    def _part_paths(self) -> list[str]:
        p = self.plan
        return [x for x in (p.embedding, p.position_embedding, p.final_norm, p.head) if x]

    def _make_stage_module(self, spec: StageSpec) -> _StageModule:
        parts: dict[str, nn.Module] = {f"block{i}": self._all_blocks[str(i)] for i in spec.blocks}
        loose: dict[str, nn.Parameter] = {}
        if spec.is_first:
            parts.update({path: self._real[path] for path in self._first_params})
            loose.update(self._first_loose)
        if spec.is_last:
            parts.update({path: self._real[path] for path in self._last_params})
            loose.update(self._last_loose)
        return _StageModule(self, spec, parts, loose)

    def _stand_in_loose(self, names: dict[str, nn.Parameter]) -> None:
        """On a rank without the stage that owns them, loose parameters become zeros of their
        shape, not parameters: the forward still reads them before the first block (its result
        is replaced by the received activation) or never reaches them, and they stay out of this
        rank's optimizer, gradient norm and state dict (the owning stage's copy is the one)."""
        for name, param in names.items():
            owner_path, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_path) if owner_path else self.module
            delattr(owner, attr)
            owner.register_buffer(attr, torch.zeros(param.shape, dtype=param.dtype, device=self.device), persistent=False)

    def _set(self, path: str, new: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        setattr(self.module.get_submodule(parent_path) if parent_path else self.module, name, new)

    def _placeholder(self, path: str) -> _Placeholder:
        return _Placeholder(path, self, produces_activation=path in self._first_params)

    def _rest(self) -> None:
        """Between steps: this rank's blocks (under their global indices) and the parts its stages own."""
        self._container._modules = dict(self._all_blocks)
        first = any(s.is_first for s in self.specs)
        last = any(s.is_last for s in self.specs)
        for path in self._first_params:
            self._set(path, self._real[path] if first else self._placeholders[path])
        for path in self._last_params:
            self._set(path, self._real[path] if last else self._placeholders[path])

    @contextmanager
    def _placed(self, spec: StageSpec, incoming: Tensor | None) -> Generator[None, None, None]:
        """The module as stage ``spec`` sees it, for one forward."""
        blocks = [self._all_blocks[str(i)] for i in spec.blocks]
        self._container._modules = self._stage_view(spec)
        for path in self._first_params:
            self._set(path, self._real[path] if spec.is_first else self._placeholders[path])
        for path in self._last_params:
            self._set(path, self._real[path] if spec.is_last else self._placeholders[path])
        handles = []
        if not spec.is_first:
            handles.append(blocks[0].register_forward_pre_hook(self._inject, with_kwargs=True))
        if not spec.is_last:
            handles.append(blocks[-1].register_forward_hook(_stop_at_boundary))
        self._incoming, self.running_stage = incoming, spec.index
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._incoming, self.running_stage = None, None
            self._rest()

    def _stage_view(self, spec: StageSpec) -> dict[str, nn.Module]:
        """The block container's entries while stage ``spec`` runs. A list is indexed by position
        (``nn.TransformerEncoder`` reads ``self.layers[0]``): the stage's blocks from "0". A
        ModuleDict keeps the global keys the model may look up. Between steps the global keys
        return (:meth:`_rest`): they name the parameters in state dicts and checkpoints."""
        if isinstance(self._container, nn.ModuleDict):
            return {str(i): self._all_blocks[str(i)] for i in spec.blocks}
        return {str(k): self._all_blocks[str(i)] for k, i in enumerate(spec.blocks)}

    def _inject(self, block: nn.Module, args: tuple, kwargs: dict):
        if self._incoming is None:
            return None
        x, self._incoming = self._incoming, None  # only the first call of the block
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, self._first_block_arg: x}

    def placeholder_activation(self, path: str | None = None) -> Tensor:
        if self._activation_meta is None:
            raise PipelineError("internal: the activation shape is not known yet (the probe has not run)")
        shape, dtype = self._part_meta.get(path, self._activation_meta)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ running
    def running_microbatch(self) -> tuple[int, list]:
        """(the microbatch whose step runs on this rank now, -1 outside one; this run's microbatches)."""
        return self._running, self._microbatches

    def weigh_microbatches(self, counts: list[float] | None) -> None:
        """Weight this run's logged means and returned scalars by ``counts`` (the targets each microbatch's
        cross-entropy counts: parallel/token_mean.py), or not at all (None), as one process's batch mean."""
        self._weights = counts

    def run_stage(self, spec: StageSpec, x: Tensor) -> Tensor:
        mb = self.current_microbatch[spec.index]
        with self._placed(spec, None if spec.is_first else x), self._module_calls(mb):
            self._running = mb
            try:
                result = self._step_fn(self._microbatches[mb])
            except _StageBoundary as stop:
                return stop.output
            finally:
                self._running = -1
        if not spec.is_last:
            raise PipelineError(
                f"the step finished on pipeline stage {spec.index} without running its blocks "
                f"{spec.blocks.start}..{spec.blocks.stop - 1}; under pp every step must run the model's blocks."
            )
        self._results[mb] = result
        if not torch.is_grad_enabled() or self._mode == PipelineMode.EVAL:
            return torch.zeros((), device=self.device)  # forward only: any output (predictions) is kept as is
        return _loss_of(result, self.device)

    @contextmanager
    def _module_calls(self, mb: int) -> Generator[None, None, None]:
        """While the step runs on a stage: ``self.log`` recorded for microbatch ``mb``, ``self.all_gather`` refused."""
        records = self._logs.setdefault(mb, [])

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            records.append((name, _to_number(name, value), log_options(args, kwargs)))

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            # Only the last stage reaches the step's end, and no stage reaches it in step with the
            # others: the gather would wait forever (it did, until the run's time limit).
            raise PipelineError(
                "self.all_gather inside a step under pp: each stage runs the step only up to its blocks, "
                "the last one to its end, so the ranks would never meet in the gather. Gather in a hook after "
                "the step (on_train_batch_end / on_validation_batch_end / on_predict_batch_end get the batch's "
                "output on every rank), or use pp=1."
            )

        # In front of the step region's logs (tp's plain values, cp's token weighting), which the
        # recorded values meet when the strategy logs them after the run (batch.apply_logs).
        with log_through(self.module, lambda _region_log: log):
            with shadowed(self.module, "all_gather", lambda _own: all_gather):
                yield

    def run(self, mode: PipelineMode, step_fn: Callable[[Any], Any], batch: Any) -> tuple[Any, list]:
        """One pipeline run of ``batch``: returns (merged step output, logged (name, mean, options)).

        Both are the last stage's, sent to every pipeline rank, so each rank returns and logs the same.
        """
        self._step_fn, self._results, self._logs, self._mode = step_fn, {}, {}, mode
        self._weights = None
        try:
            if mode == PipelineMode.TRAIN:
                self._train(batch)
                return self._share_last_stage_results()
            self._microbatches = split_microbatches(batch, self.microbatches)
            self._probe_activation()
            outcome = self._forward_only().run()
            return self._share_last_stage_results(outcome)
        finally:
            self._step_fn, self._microbatches, self._results, self._logs = None, [], {}, {}

    def _train(self, batch: Any) -> None:
        """The schedule, then every rank of the world agrees on whether any rank failed (:mod:`.failure`).

        A failure before the schedule (a batch that does not split, a probe that fails) is the
        same on every rank of this pipe (they read the same batch; the probe's error is
        broadcast), so the whole pipe skips the schedule and still meets the others at the flag.
        """
        self.failures = StepFailures()  # nothing left over from a run that torch's own code ended
        try:
            self._microbatches = split_microbatches(batch, self.microbatches)
            self._probe_activation()
        except Exception as err:  # noqa: BLE001 - raised on every rank by agree(), below
            self.failures.record(err)
        if not self.failures.failed:
            # A check may fail on some stages only: such a rank keeps its place in the schedule
            # with stand-ins, so that its peers finish the run and meet it at the flag.
            for check in self.checks_before_run:
                try:
                    check()
                except Exception as err:  # noqa: BLE001 - raised on every rank by agree(), below
                    self.failures.record(err)
            self._run_schedule()
        self.failures.agree(self.device)

    def _run_schedule(self) -> None:
        schedule = self._schedule_for(PipelineMode.TRAIN)
        self.times.busy_s = 0.0
        self.times.peak_in_flight = {}
        for stage in self._stages_of(schedule):
            stage._held = 0
        index = torch.arange(self.microbatches, device=self.device)
        start = time.perf_counter()
        try:
            schedule.step(index, target=index, return_outputs=False)
        finally:
            self.times.wall_s = time.perf_counter() - start

    def _forward_only(self) -> ForwardOnlyRun:
        return ForwardOnlyRun(
            stages=self._stage_modules,
            owner=self.owner,
            rank=self.rank,
            microbatches=self.microbatches,
            group=self.group,
            device=self.device,
            activation=self._activation_meta,
            current_microbatch=self.current_microbatch,
        )

    def _share_last_stage_results(self, outcome: ForwardOnlyOutcome | None = None) -> tuple[Any, list]:
        """The last stage's outputs and logs on every pipeline rank; after a forward-only run in
        which a stage failed, every pipeline rank raises instead (``outcome``: this rank's view)."""
        failed = outcome.failed if outcome is not None else None
        last_rank = self.owner[-1]
        payload = None
        if self.rank == last_rank:
            if failed is not None:  # a stage failed: no results, every rank learns which rank
                payload = (None, [], failed)
            else:
                results = [self._results[i] for i in range(self.microbatches)]
                logged = _combine_logs([self._logs.get(i, []) for i in range(self.microbatches)], self._weights)
                # On the host: unpickled tensors would otherwise land on the last stage's GPU everywhere.
                merged = merge_step_outputs(results, self._weights)
                out = apply_to_collection(merged, Tensor, lambda t: t.detach().cpu())
                payload = (out, logged, None)
        box = [payload]
        dist.broadcast_object_list(box, group=self.group, group_src=last_rank)
        out, logged, failed = box[0]
        if failed is not None:
            raise_failure(failed, outcome.own if outcome is not None else None)
        return apply_to_collection(out, Tensor, lambda t: t.to(self.device)), logged

    def _probe_activation(self) -> None:
        """Shape and dtype of the first block's input for this microbatch shape, from the first stage."""
        key = _shapes(self._microbatches[0])
        if self._activation_meta is not None and self._probed_for == key:
            return
        meta, error, parts = None, None, {}
        if self.owner[0] == self.rank:
            first = self._all_blocks["0"]
            self._container._modules = {"0": first}
            self._set(self.plan.embedding, self._real[self.plan.embedding])
            handle = first.register_forward_pre_hook(_stop_at_input, with_kwargs=True)
            part_handles = [
                self._real[path].register_forward_hook(functools.partial(_record_output, parts, path))
                for path in self._first_params
            ]
            try:
                with torch.no_grad(), self._module_calls(-1):
                    self._step_fn(self._microbatches[0])
            except _StageBoundary as stop:
                meta = (tuple(stop.output.shape), stop.output.dtype)
            except Exception as err:  # every stage must hear of it, or they wait for the shape forever
                error = f"{type(err).__name__}: {err}"
            finally:
                handle.remove()
                for h in part_handles:
                    h.remove()
                self._logs.pop(-1, None)
                self._rest()
                reset_stopped_forward(self.module)  # ZeRO-3: the first block's unit, gathered before the stop
            if meta is None and error is None:
                error = (
                    f"the step never called the model's first block ({self.plan.block_path(0)}); under pp the "
                    f"strategy runs the user's step to find the activations' shape."
                )
        box = [(meta, error, parts)]
        dist.broadcast_object_list(box, group=self.group, group_src=self.owner[0])
        meta, error, self._part_meta = box[0]
        if error is not None:
            raise PipelineError(f"pipeline stage 0 could not run the step up to the first block: {error}")
        self._activation_meta = (torch.Size(meta[0]), meta[1])
        self._probed_for = key

    def _schedule_for(self, mode: PipelineMode):
        key = (mode, self._activation_meta)
        if key not in self._schedules:
            shape, dtype = self._activation_meta
            # requires_grad tells torch's static stage metadata that gradients travel back
            act = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=mode == PipelineMode.TRAIN)
            stages = []
            for spec in self.specs:
                stages.append(
                    TimedStage(
                        self._stage_modules[spec.index],
                        spec.index,
                        self.num_stages,
                        self.device,
                        input_args=torch.zeros(1, dtype=torch.long, device=self.device) if spec.is_first else act,
                        output_args=torch.empty((), device=self.device) if spec.is_last else act,
                        group=self.group,
                        runtime=self,
                    )
                )
            cls = schedule_class(self.schedule)
            loss_fn = self._scaled_loss
            stage_arg = (
                stages if len(stages) > 1 or cls.__name__ not in ("ScheduleGPipe", "Schedule1F1B") else stages[0]
            )
            scale_grads = not self.divide_loss_by_microbatches
            self._schedules[key] = cls(stage_arg, self.microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        return self._schedules[key]

    @staticmethod
    def _stages_of(schedule) -> list:
        return list(getattr(schedule, "_stages", None) or [schedule._stage])

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        # The schedule divides by m; Lightning's own 1/accumulate never reaches a backward run here.
        if self.divide_loss_by_microbatches:
            return output * (self.loss_scale / self.microbatches)
        return output * self.loss_scale

    def mean_bubble(self) -> float:
        """The last run's idle fraction, averaged over the pipeline ranks (the same number on each)."""
        bubble = torch.tensor(self.times.bubble, dtype=torch.float64, device=self.device)
        dist.all_reduce(bubble, group=self.group)
        return float(bubble) / self.pp

    # ------------------------------------------------------------------ state
    def full_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Every stage's entries, on every pipeline rank (names are the unsplit model's)."""
        parts: list[dict | None] = [None] * self.pp
        dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in state.items()}, group=self.group)
        merged: dict[str, Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged

    def local_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full state dict -> the entries of this rank's stages (no communication)."""
        local = set(self.module.state_dict())
        return {k: v for k, v in state.items() if k in local}

    def local_region(self, name: str, region: Region) -> Region:
        """A stage holds whole tensors (the names of its layers): nothing is cut."""
        return region

    def describe(self) -> str:
        ranges = ", ".join(f"{s}:{r.start}-{r.stop - 1}@{self.owner[s]}" for s, r in enumerate(self.ranges))
        return f"{self.schedule.value}, pp={self.pp} v={self.v} m={self.microbatches}; stage:blocks@rank {ranges}"


# ---------------------------------------------------------------------- helpers
def _stop_at_boundary(module: nn.Module, args: tuple, output: Any) -> None:
    raise _StageBoundary(output[0] if isinstance(output, tuple) else output)


def _record_output(record: dict, path: str, module: nn.Module, args: tuple, out: Any) -> None:
    if isinstance(out, Tensor):
        record.setdefault(path, (tuple(out.shape), out.dtype))


def _stop_at_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, Tensor))
    raise _StageBoundary(x)


def _first_argument_name(block: nn.Module) -> str:
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    params = [p for p in inspect.signature(inner.forward).parameters.values() if p.name != "self"]
    return params[0].name if params else "hidden_states"
