"""What the applied dimensions add to every training step (``FiveDStrategy`` asks this object).

:func:`lightning_5d.dimensions.apply_dimensions` builds one :class:`AppliedDimensions` per
module: the step region and sequence shard, the pipeline run, the gradient reduction and its
pause during accumulation, global-norm clipping and the checkpoint splits. The order in which
the dimensions are applied lives in ``dimensions.py``; this module holds only their runtime part.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_5d.config import LayoutError
from lightning_5d.gradient_places import GradientPlaces
from lightning_5d.gradient_reads import (
    CALLBACK_HOOKS,
    MODULE_HOOKS,
    GradientWatch,
    ManualWindow,
    watch_hooks,
)
from lightning_5d.parallel.context import ContextParallel, ContextParallelError
from lightning_5d.parallel.data import ZeroSet
from lightning_5d.parallel.data.fsdp import set_gradient_sync, unit_is_gathered
from lightning_5d.parallel.expert import ExpertParallel, ExpertParallelError
from lightning_5d.parallel.frozen import FrozenAtSetup
from lightning_5d.parallel.grad_norm import clip_grad_norm_, per_parameter_norms
from lightning_5d.parallel.pipeline import PipelineLoop, PipelineMode, PipelineParallel
from lightning_5d.parallel.step_log import shadowed
from lightning_5d.parallel.tensor import TensorParallel
from lightning_5d.parallel.tensor.plain import plain_logged_values, plain_metric_updates, plain_tensors
from lightning_5d.parallel.tensor.vocab import loss_parallel_region
from lightning_5d.parallel.token_mean import LossGroups, MicrobatchWeights, TokenMean
from lightning_5d.parameter_reads import ParameterMap, ParameterWatch
from lightning_5d.piece_reads import unwatched
from lightning_5d.precision import FiveDPrecision


class LeftOnModule:
    """What a FiveDStrategy applied to a module, kept on the module for a later Trainer's strategy.

    Dropped from pickles and deep copies: it holds process groups.
    """

    ATTRIBUTE = "_lightning_5d_dimensions"

    def __init__(self, config: Any, layout: Any, applied: "AppliedDimensions") -> None:
        self.config, self.layout, self.applied = config, layout, applied

    def __reduce__(self):
        return (type(None), ())

    def __deepcopy__(self, memo: dict) -> None:
        return None


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
    _tied_copies: set[int] = field(default_factory=set)  # a tied weight's copy another pp rank counts
    frozen: FrozenAtSetup | None = None  # parameters frozen at setup that must stay so (watch_frozen)
    frozen_masters: FrozenAtSetup | None = None  # frozen bf16 ones without an fp32 master (this fit's)
    metrics: list = field(default_factory=list)  # the module's torchmetrics objects, found at setup
    _unwatch_hooks: Callable[[], None] | None = None  # puts the user's gradient hooks back (watch_gradient_reads)
    gradient_places: GradientPlaces | None = None  # this fit's (watch_gradient_reads)
    _watch: GradientWatch | None = None  # this fit's watch on the user's gradient hooks
    manual_window: ManualWindow = field(default_factory=ManualWindow)
    _parameter_watch: ParameterWatch | None = None  # this fit's watch on the user's training_step
    _all_names: list[str] | None = None  # every rank's parameter names, one order (grad_norms)
    loss_groups: LossGroups | None = None  # the ranks holding parts of one batch (parallel/token_mean.py)

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

    @property
    def cuts_module(self) -> bool:
        """Whether the module itself was changed (cut, staged, wrapped or sharded): it cannot be
        applied again. ZeRO-0..2 alone only hook its parameters: a new strategy re-applies them."""
        return any(x is not None for x in (self.tp, self.ep, self.cp, self.pp)) or bool(self.fsdp_units)

    def leave_on(self, module: nn.Module, config: Any, layout: Any) -> None:
        object.__setattr__(module, LeftOnModule.ATTRIBUTE, LeftOnModule(config, layout, self))

    @staticmethod
    def left_on(module: nn.Module) -> LeftOnModule | None:
        return module.__dict__.get(LeftOnModule.ATTRIBUTE)

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
        self.unwatch_gradient_reads()
        if self.zero is not None:
            self.zero.active = False  # hooks stay for a later fit/validate with this Trainer

    # ------------------------------------------------------------------ checkpoint
    @property
    def splits(self) -> list:
        """tp, ep and pp in that order: each turns full tensors into its pieces and back."""
        return [x for x in (self.tp, self.ep, self.pp) if x is not None]

    # ------------------------------------------------------------------ step
    @contextmanager
    def step_region(self, module: nn.Module, mode: PipelineMode) -> Iterator[None]:
        with ExitStack() as stack:
            if self.tp is not None:  # the user's F.cross_entropy on vocab-sharded logits
                stack.enter_context(loss_parallel_region())
            if self.cp is not None:
                stack.enter_context(self.cp.step_region(module))
            token_mean = self._token_mean(mode)
            if token_mean is not None:  # innermost: sees F.cross_entropy first, tp's answers its sum
                stack.enter_context(token_mean)
            yield

    def _token_mean(self, mode: PipelineMode) -> TokenMean | None:
        """The step's cross-entropy as the mean over the batch's tokens (parallel/token_mean.py): over the
        data and cp ranks for a loss backpropagated in training, over cp for any other value (Lightning's
        sync_dist combines data ranks), and over the pipeline's microbatches; None where the step holds
        the whole batch."""
        if self.loss_groups is None:
            return None
        backward = self.loss_groups.train if mode == PipelineMode.TRAIN else None
        values = self.loss_groups.eval
        weights = None
        if self.pp is not None:
            weights = MicrobatchWeights(self.pp.running_microbatch, shifts=self.cp is None,
                                        record=self.pp.weigh_microbatches)  # fmt: skip
        if weights is None and values[1] == 1 and (backward is None or backward[1] == 1):
            return None
        mark = self.cp.mark_global if self.cp is not None else None
        return TokenMean(backward, values, mark=mark, microbatches=weights)

    def run_step(
        self, module: nn.Module, mode: PipelineMode, step: Callable[..., Any], args: tuple, kwargs: dict,
        keep_shard: bool,
    ) -> Any:  # fmt: skip
        """The user's step on this rank's sequence shard; ``keep_shard`` leaves it current for backward."""
        cp = self.cp
        if cp is not None and args:
            args = (cp.begin(args[0]), *args[1:])
        step = self._plain_edges(module, step)
        if self.fsdp_units and self.fsdp_units[-1] is module:
            step = _through_forward(module, step)
        try:
            with self.step_region(module, mode):
                out = step(*args, **kwargs)
        except BaseException:
            if cp is not None:
                cp.end()
            raise
        if cp is not None and not keep_shard:
            cp.end()
        return out

    def _plain_edges(self, module: nn.Module, step: Callable[..., Any]) -> Callable[..., Any]:
        """Under tp: ``step`` whose outputs, logged values and metric updates get plain tensors (tensor/plain.py).

        Its log is the innermost: the user's ``self.log`` meets it before cp's token weighting
        or the pipeline's per-microbatch record, which expect plain tensors."""
        if self.tp is None:
            return step

        def run(*args: Any, **kwargs: Any) -> Any:
            with plain_logged_values(module), plain_metric_updates(self.metrics):
                return plain_tensors(step(*args, **kwargs))

        return run

    def pipeline_step(
        self, module: nn.Module, mode: PipelineMode, step: Callable[..., Any], args: tuple, kwargs: dict,
        device: torch.device,
    ) -> Any:  # fmt: skip
        """One Lightning batch as one pipeline run; the user's step runs per microbatch on each stage."""
        assert self.pp_loop is not None
        batch, rest = args[0], args[1:]
        step = self._plain_edges(module, step)
        return self.pp_loop.run(
            mode,
            lambda mb: step(mb, *rest, **kwargs),
            batch,
            zero=self.zero,
            fsdp_units=self.fsdp_units,
            cp=self.cp,
            step_region=lambda: self.step_region(module, mode),
            device=device,
        )

    def align_random_stream(self, step: int) -> None:
        """Before a training step: the tp ranks of a replica draw one random stream (tensor/random_stream.py)."""
        if self.tp is not None:
            self.tp.random_stream.align(step)

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
    def gradient_sync_paused(self, precision: FiveDPrecision | None) -> Iterator[None]:
        """No gradient reduction inside (micro-batches that only accumulate). With fp32 accumulation
        every micro-batch is still reduced and summed in fp32 (ZeRO-3: in FSDP2's fp32 shards)."""
        if precision is not None and precision.fp32_accumulation:
            yield
            return
        if self.zero is not None:
            self.zero.require_sync = False
        set_gradient_sync(self.fsdp_units, False)
        try:
            yield
        finally:
            if self.zero is not None:
                self.zero.require_sync = True
            set_gradient_sync(self.fsdp_units, True)

    def watch_frozen(self, module: nn.Module) -> None:
        """Once every dimension is applied: remember the frozen parameters the ZeRO-0..2 engines and
        tp's partial-gradient hooks leave out (``parallel/frozen.py``)."""
        zero = int(self.zero.stage) if self.zero is not None else None
        tp_partial = self.tp.sequence_partial if self.tp is not None and self.tp.partial_grads_hooked else None
        self.frozen = FrozenAtSetup.watch(module, zero, tp_partial)
        if self.pp is not None:
            # Stages hold different parameters: checked inside the run, whose failure flag stops
            # every rank with it (a check after the run would leave the other stages waiting).
            self.pp.checks_before_run.append(self.check_frozen)

    def watch_masters(self, module: nn.Module, precision: FiveDPrecision) -> None:
        """After this fit's optimizers got their fp32 masters: the frozen bf16 parameters left without one."""
        self.frozen_masters = FrozenAtSetup.without_masters(module, precision.frozen_without_master)

    def check_frozen(self) -> None:
        for watch in (self.frozen, self.frozen_masters):
            if watch is not None:
                watch.check()

    def start_backward(self) -> None:
        """Before each backward's gradients are reduced (under pp: after the schedule's backward,
        whose run checked the frozen parameters already: watch_frozen)."""
        if self.pp is None:
            self.check_frozen()
        if self.zero is not None:
            self.zero.start_backward()
        if self.gradient_places is not None:
            self.gradient_places.tp_sums_pending = True  # SP's partial sums until sync_sequence_parallel

    def finish_gradient_sync(self) -> None:
        if self.zero is not None:
            self.zero.finish_gradient_sync()

    def sync_sequence_parallel(self, module: nn.Module, accumulating: bool) -> None:
        # FSDP2 reduced this step's gradients; SP's norm weights and per-head q/k norms still
        # need their sum over tp.
        if self.tp is not None and self.fsdp_units and self.tp.has_partial_grads and not accumulating:
            self.tp.sync_sequence_parallel_grads(module)
            if self.gradient_places is not None:
                self.gradient_places.tp_sums_pending = False

    def pipeline_backward(self, module: nn.Module, accumulating: bool) -> None:
        """The schedule already ran the backward: restore its gradients and reduce them all now."""
        assert self.pp_loop is not None
        self.start_backward()  # as before any backward: it may clear the module's gradients
        self.pp_loop.restore_gradients()
        self.finish_gradient_sync()  # no hook fired during the schedule: reduce all of them now
        self.sync_sequence_parallel(module, accumulating)  # the schedule's run reduced them (pipeline/fsdp.py)

    def check_units_sharded(self) -> None:
        """Before the optimizers are built: every ZeRO-3 unit resharded, or raise. A gathered unit's
        registered parameters are FSDP2's unsharded copies, which the optimizer would update while
        training computes with the shards (a stage that silently never trains). A forward without
        a backward leaves the root (and the last block) gathered by design, e.g. a validate before
        this fit: each root's recovery reshards them. What is still gathered then is a bug."""
        for unit in self.fsdp_units:
            if fully_shard.state(unit)._is_root:
                unit.reset_iter_state()
        gathered = [type(u).__name__ for u in self.fsdp_units if unit_is_gathered(u)]
        if gathered:
            raise RuntimeError(
                f"lightning_5d internal error: {len(gathered)} ZeRO-3 units ({', '.join(gathered[:4])}) are still "
                f"gathered after setup, so the optimizer would hold their unsharded copies and never train them. "
                f"Please report it with the layout."
            )

    # ------------------------------------------------------------------ gradient hooks
    def watch_gradient_reads(self, module: nn.Module, callbacks: list, places: GradientPlaces) -> None:
        """The user's gradient hooks (the module's and its callbacks') run watched for reads that
        would differ from one process's (``gradient_reads``), when any can differ under this layout."""
        self.unwatch_gradient_reads()
        self.gradient_places = places
        self._watch = GradientWatch(places.gradient_map())
        if not self._watch.map.needed:
            return
        owners = [(module, MODULE_HOOKS, type(module).__name__)]
        owners += [(cb, CALLBACK_HOOKS, type(cb).__name__) for cb in callbacks if _overrides_gradient_hook(cb)]
        self._unwatch_hooks = watch_hooks(self._watch, module, owners)

    def open_manual_window(self, module: nn.Module) -> None:
        """After a ``manual_backward``: the rest of the user's step is watched like a gradient hook."""
        if self._watch is not None:
            self.manual_window.open(self._watch, module, f"{type(module).__name__}.training_step after manual_backward")

    def watch_parameter_reads(self, module: nn.Module) -> None:
        """The user's ``training_step`` runs watched for values computed from parameters that would
        differ from one process's (``parameter_reads``), when any can differ under this layout."""
        self._drop_parameter_watch()
        parameters = ParameterMap.of(module, self.tp, self.ep, self.pp, zero3=bool(self.fsdp_units))
        if parameters.needed:
            self._parameter_watch = ParameterWatch(module, parameters)

    def watched_training_step(self, module: nn.Module) -> AbstractContextManager:
        """Inside: ``module.training_step`` runs watched (``watch_parameter_reads``). Shadowed per
        step, after Lightning has read the step's signature, like the step regions."""
        watch = self._parameter_watch
        if watch is None:
            return nullcontext()
        context = f"{type(module).__name__}.training_step"
        return shadowed(module, "training_step", lambda step: watch.step(step, context))

    def unwatch_gradient_reads(self) -> None:
        """The user's hooks and step as they were (the fit ends)."""
        self.manual_window.close()
        if self._unwatch_hooks is not None:
            self._unwatch_hooks()
            self._unwatch_hooks = None
        self._drop_parameter_watch()

    def _drop_parameter_watch(self) -> None:
        if self._parameter_watch is not None:
            self._parameter_watch.remove()  # its hooks on every module
            self._parameter_watch = None

    def grad_norms(self, module: nn.Module, norm_type: float, device: torch.device) -> dict:
        """Each parameter's whole-gradient norm by one-process name, on every rank (collective): what
        one process's ``grad_norm`` computes, from the pieces this rank holds."""
        if self.gradient_places is None:
            raise RuntimeError("lightning_5d.grad_norm needs a fit's gradients: call it from a training hook.")
        with unwatched():  # called from a watched hook: these reads know where the pieces are
            held = [n for n, _ in module.named_parameters() if self.pp is None or not self.pp.tied.counts_elsewhere(n)]
            if self._all_names is None:  # other stages' and other ep ranks' names too, once per fit
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, held)
                self._all_names = list(dict.fromkeys(n for names in everyone for n in names))
            experts = self.ep is not None and self.ep.ep > 1
            return per_parameter_norms(
                self.gradient_places.pieces(module, held),
                self._all_names,
                norm_type,
                device=device,
                tp_group=self.tp.group if self.tp is not None else None,
                tp_sharded=self.tp.is_sharded if self.tp is not None else (lambda name: False),
                expert_group=self.ep.group if experts else None,
                is_expert=self.ep.is_expert if experts else (lambda name: False),
                stage_group=self.pp.group if self.pp is not None else None,
            )

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
        self._tied_copies = {i for i, n in names.items() if self.pp is not None and self.pp.tied.counts_elsewhere(n)}

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        with unwatched():  # inside configure_gradient_clipping: these reads know where the pieces are
            self._clip_grad_by_norm(optimizer, clip_val)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded, experts, copies = self._tp_sharded, self._experts, self._tied_copies
        clip_grad_norm_(
            params,
            float(clip_val),
            lambda p: id(p) in sharded,
            self.tp.group if self.tp is not None else None,
            stage_group=self.pp.group if self.pp is not None else None,
            is_expert=lambda p: id(p) in experts,
            expert_group=self.ep.group if self.ep is not None else None,
            counted_elsewhere=lambda p: id(p) in copies,
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


def _overrides_gradient_hook(callback: Any) -> bool:
    """Whether a callback implements a gradient hook (Lightning's own callbacks implement none)."""
    return any(getattr(type(callback), h, None) is not getattr(Callback, h) for h in CALLBACK_HOOKS)
