"""What a user's ``training_step`` computes from the parameters themselves, checked against one process.

In one process every parameter is whole, and users compute with them in the step: a penalty on
the weights added to the loss (``c * sum(p.pow(2).sum() for p in self.parameters())``, an L1 or
an L2-SP term toward the starting weights), a norm logged for monitoring, or the loss itself
from a layer's weight (``F.linear(hidden, self.lm_head.weight)`` for a chunked cross-entropy).
Under the layouts a parameter outside the model's forward is often something else:

* under tp a cut parameter is its shard, so a sum or mean of it is this rank's part only
  (before: a mean-of-squares penalty on the embedding, tp2, 1.8e-3 relative parameter error
  after 3 steps); a replicated parameter whose gradient tp sums over its ranks (sequence
  parallelism's norm weights, per-head q/k norms) gets a term computed on every tp rank tp times
  (a penalty on one norm weight, tp2 with SP, SGD: that weight 0.30 off after 3 steps);
* under ep a routed-experts parameter holds only this rank's experts (a penalty over
  ``self.parameters()``: 4.8e-2);
* under pp the step runs on the last stage, which holds only its parameters (the same penalty:
  7.3e-2) and sees its blocks re-keyed from 0 (a penalty on ``layers[0]`` trained another block:
  0.17 with SGD);
* under ZeRO-3 a parameter is a sharded DTensor, and torch's backward fails on anything computed
  from it and added to the plain loss ("got mixed torch.Tensor and DTensor").

All silent but the last (benchmarks/RESULTS.md "training_patterns").

:class:`ParameterWatch` watches the user's ``training_step``, outside the model's modules: a
``TorchFunctionMode`` (``piece_reads.PieceReads``) that is on the mode stack only while the step's
own code runs; each module call of the model takes it off until it returns, so the layers'
forwards, which the dimensions cut as they must, pay nothing and are not checked. A parameter
that is a piece here (a tp or expert shard, a block of the last pp stage) labels what is computed
from it; a reduction of a piece, a function combining elements along a dimension of one, a value
combining several parameters under pp, a DTensor parameter mixed with the plain loss under
ZeRO-3, a term on a parameter whose gradient tp sums reaching the backward, and a piece handed to
a module from the step are refused at the first step, naming the parameter, what this rank holds
of it and what to do instead. Element-wise work (an EMA copy, ``p.data.clamp_``) passes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lightning_5d.piece_reads import Label, PieceReads, remove_mode, tensors_in

_FIX = (
    "A penalty on the weights belongs in the optimizer: its weight_decay (AdamW's is decoupled; "
    "torch.optim.SGD's or Adam's weight_decay=2*c adds exactly the gradient of c * sum(p.pow(2).sum())), which "
    "every layout applies to whole parameters. To compute with a layer, call its module (e.g. "
    "self.model.lm_head(hidden)) rather than reading its weight, so the layout cuts the computation as it must. "
    "Element-wise work on parameters (an EMA copy) is fine; trainer.strategy.full_model_state() gives the whole "
    "parameters (a collective)."
)


class ParameterReadError(RuntimeError):
    """A training step computed a value from parameters that on this rank are not what one process holds."""


class ParameterHere(Enum):
    """What a parameter is on this rank while the user's step runs, outside the model's forward."""

    WHOLE = "whole"  # the one-process parameter (under ZeRO-3 a DTensor: its ops see the whole)
    TP_SHARD = "tp_shard"  # 1/tp of it, cut by tensor parallelism
    EXPERT_SHARD = "expert_shard"  # this ep rank's experts of a routed-experts parameter
    TP_SUMMED = "tp_summed"  # whole, but tp sums its gradient over its ranks (SP's norms, q/k norms)
    STAGE_BLOCK = "stage_block"  # pp: a block of the last stage, whose container the step sees re-indexed

    @property
    def piece(self) -> bool:
        return self in (ParameterHere.TP_SHARD, ParameterHere.EXPERT_SHARD, ParameterHere.STAGE_BLOCK)

    def describe(self, sizes: Mapping[str, int]) -> str:
        return {
            ParameterHere.TP_SHARD: f"its tensor-parallel shard (1/{sizes.get('tp')} of the parameter)",
            ParameterHere.EXPERT_SHARD: f"only this ep rank's experts (1/{sizes.get('ep')} of them)",
            ParameterHere.STAGE_BLOCK: (
                f"one of the last stage's blocks: under pp={sizes.get('pp')} the step runs on the last stage, which "
                f"holds only its blocks and sees them indexed from 0 (layers[0] there is another block than in one "
                f"process)"
            ),
        }.get(self, "the whole parameter")


@dataclass(frozen=True)
class ParameterMap:
    """Where each parameter is on this rank, by one-process name (the same on every step of a fit)."""

    where: Mapping[str, ParameterHere]
    sizes: Mapping[str, int]
    stage: int = 0
    stages: int = 1
    dtensor_parameters: bool = False  # ZeRO-3: parameters are DTensors outside the forward
    shard_dims: Mapping[str, int] = field(default_factory=dict)  # tp: the dimension each shard is cut along

    @classmethod
    def of(cls, module: nn.Module, tp: Any, ep: Any, pp: Any, zero3: bool) -> "ParameterMap":
        """From the dimensions applied to ``module`` (each None where absent), between steps (pp's
        blocks under their global names)."""
        summed = frozenset(tp.sequence_partial) if tp is not None else frozenset()
        blocks = f"{pp.plan.blocks}." if pp is not None else None

        def where(name: str) -> ParameterHere:
            if blocks is not None and name.startswith(blocks):
                return ParameterHere.STAGE_BLOCK
            if ep is not None and ep.ep > 1 and ep.is_expert(name):
                return ParameterHere.EXPERT_SHARD
            if tp is not None and tp.is_sharded(name):
                return ParameterHere.TP_SHARD
            return ParameterHere.TP_SUMMED if name in summed else ParameterHere.WHOLE

        return cls(
            where={name: where(name) for name, _ in module.named_parameters()},
            sizes={"tp": tp.size if tp is not None else 1, "ep": ep.ep if ep is not None else 1,
                   "pp": pp.pp if pp is not None else 1},  # fmt: skip
            shard_dims={name: cut.dim for name, cut in tp.shards.items()} if tp is not None else {},
            stage=pp.rank if pp is not None else 0,
            stages=pp.pp if pp is not None else 1,
            dtensor_parameters=zero3,
        )

    @property
    def needed(self) -> bool:
        """Whether any read could differ from one process's (otherwise the step is not watched)."""
        return self.stages > 1 or self.dtensor_parameters or any(w != ParameterHere.WHOLE for w in self.where.values())


class ParameterWatch:
    """One fit's watch on the user's ``training_step``: the parameters' labels, and hooks on every
    module of the model that take the step's mode off torch's stack while a module runs."""

    def __init__(self, root: nn.Module, parameters: ParameterMap) -> None:
        self.map = parameters
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weak: a label dies with its tensor
        self._root = root
        self._unlabelled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter objects that need none
        # Between steps: under pp the step sees the last stage's blocks re-keyed from 0; labels and
        # messages use the model's own names.
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for name, param in root.named_parameters():
            self._names[param] = name
        self.label_parameters()
        self._calls: list[nn.Module] = []  # module calls in progress, innermost last
        self._base = 0  # how many were in progress when the watched step started
        self._mode: ParameterReads | None = None
        self._hooks: list = []
        self.add_hooks()

    def add_hooks(self) -> None:
        """The hooks that take the step's mode off the stack while a module of the model runs."""
        self.remove()
        for module in self._root.modules():
            self._hooks.append(module.register_forward_pre_hook(self._module_starts, prepend=True, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._module_ends, always_call=True))

    def label_parameters(self) -> None:
        """Label the model's parameter objects as they are now. ZeRO-3 registers a unit's gathered
        parameters in place of its shards while the unit is gathered (the last block stays so from
        its forward to its backward), so a step can meet parameter objects that setup never saw."""
        every = self.map.stages > 1 or self.map.dtensor_parameters  # pp: the names combined; ZeRO-3: mixing
        for name, param in self._root.named_parameters():
            name = self._names.get(param, name)
            where = self.map.where.get(name, ParameterHere.WHOLE)
            if every or where != ParameterHere.WHOLE:
                self.labels[param] = Label(frozenset({name}), where, name)
            else:
                self._unlabelled[param] = True

    def meet(self, param: Tensor) -> None:
        """A parameter object the step computes with: labelled now if it needs a label."""
        if param in self.labels or param in self._unlabelled:
            return
        self.label_parameters()
        if param not in self.labels:
            self._unlabelled[param] = True  # the model's whole one, or not the model's (the user's own)

    def _module_starts(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        self._calls.append(module)
        if self._mode is None or len(self._calls) != self._base + 1:
            return
        remove_mode(self._mode)  # the layer's forward is the layout's: neither checked nor slowed
        if not self._mode.is_paused:
            # A piece handed to a module from the step (a loss module given the head's weight, as a
            # fused linear cross-entropy takes it): what the module computes with it is not watched.
            # (Refused after the bookkeeping: torch still runs the always-called hook below.)
            self._mode.refuse_pieces_given(module, (args, kwargs))

    def _module_ends(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self._calls or self._calls[-1] is not module:
            return  # its start hook never ran (an earlier pre-hook raised)
        self._calls.pop()
        if self._mode is not None and len(self._calls) == self._base:
            torch.overrides._push_mode(self._mode)

    def step(self, method: Callable[..., Any], context: str) -> Callable[..., Any]:
        """``method`` (the user's step) run watched."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if self._mode is not None:  # a step called from inside the step: already watched
                return method(*args, **kwargs)
            self._mode, self._base = ParameterReads(self, context), len(self._calls)
            torch.overrides._push_mode(self._mode)
            try:
                return method(*args, **kwargs)
            finally:
                mode, self._mode = self._mode, None
                remove_mode(mode)

        run.__wrapped__ = method  # type: ignore[attr-defined]
        return run

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


# Functions that keep the shape but combine elements along a dimension.
_ALONG_A_DIMENSION = frozenset(
    {"normalize", "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
     "sort", "argsort", "layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "local_response_norm"}
)  # fmt: skip
_DIM_AT = {"normalize": 2, "sort": 1, "argsort": 1}  # the positional index of ``dim`` where it is not 1
_DIM_DEFAULT = {"normalize": 1, "sort": -1, "argsort": -1}
_PARAMETER_WALKS = frozenset({"parameters", "named_parameters"})  # Module's generators of parameters


def _dim_of(name: str, args: tuple, kwargs: dict) -> int | None:
    """The dimension a function of ``_ALONG_A_DIMENSION`` combines along, where it names one."""
    if name in ("layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "local_response_norm"):
        return None
    at = _DIM_AT.get(name, 1)
    dim = kwargs.get("dim", args[at] if len(args) > at else _DIM_DEFAULT.get(name))
    return dim if isinstance(dim, int) else None


def _grad_getter(func) -> bool:
    return getattr(func, "__self__", None) is torch._C.TensorBase.grad


class ParameterReads(PieceReads):
    """The mode of one step call: labels what is computed from the parameters and refuses what
    would differ from one process's value."""

    def __init__(self, watch: ParameterWatch, context: str) -> None:
        super().__init__(watch.labels, watch.map.stages, watch.map.stage, context)
        self._map, self._watch = watch.map, watch

    def intercept(self, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        if _grad_getter(func):  # p.grad is the gradient, not the parameter (gradient_reads watches it)
            return True, func(*args, **kwargs)
        return False, None

    def meet(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            if isinstance(t, nn.Parameter):
                self._watch.meet(t)

    def before(self, name: str, label: Label, inputs: list[tuple[Tensor, Label]], args: tuple, kwargs: dict) -> None:
        if name not in _ALONG_A_DIMENSION or not label.partial:
            return
        # Keeps the shape but combines elements along a dimension (a softmax, a normalization, a
        # running sum): right on a shard only along another dimension than the cut, which is known
        # for a cut parameter itself.
        first, first_label = inputs[0]
        cut = self._map.shard_dims.get(first_label.name) if isinstance(first, nn.Parameter) else None
        dim = _dim_of(name, args, kwargs)
        if cut is not None and dim is not None and first.ndim and dim % first.ndim != cut:
            return
        self.refuse(label, f"`{name}` combines elements along a dimension of a tensor computed from")

    def call(self, func, args: tuple, kwargs: dict, label: Label, inputs: list[tuple[Tensor, Label]]) -> Any:
        if not any(isinstance(t, DTensor) for t, _ in inputs):
            return func(*args, **kwargs)
        # A plain tensor that carries gradient (the loss) with a DTensor computed from a parameter:
        # torch runs the forward and fails in the backward ("got mixed torch.Tensor and DTensor").
        if any(not isinstance(t, DTensor) and t.requires_grad for t in tensors_in((args, kwargs))):
            self._refuse_mixed(func.__name__, label, "its backward fails")
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            if "mixed torch.Tensor and DTensor" not in str(error) and "not allocated yet" not in str(error):
                raise
            self._refuse_mixed(func.__name__, label, f"torch refuses it: {str(error).splitlines()[0][:120]}")

    def _refuse_mixed(self, op: str, label: Label, outcome: str) -> None:
        raise ParameterReadError(
            f"{self._context}: `{op}` mixes a value computed from {label.name}, a DTensor under ZeRO-3 (each rank "
            f"holds a shard of it outside the model's forward), with a plain tensor ({outcome}). {_FIX} Under "
            f"ZeRO-3 alone, `.full_tensor()` of a DTensor value (a collective: every rank must compute it) is the "
            f"whole value, with one process's gradient; the parameters of a unit gathered at that moment (the last "
            f"block, after the forward) are plain and whole."
        )

    def after(self, out: Any, label: Label, inputs: list[tuple[Tensor, Label]]) -> None:
        summed = [lab.name for t, lab in inputs if isinstance(t, nn.Parameter) and lab.where == ParameterHere.TP_SUMMED]
        if not summed or not torch.is_grad_enabled():
            return

        def refuse(grad: Tensor) -> Tensor:
            self._refuse_summed(summed[0], "a loss term computed from it reached the backward")

        for o in tensors_in(out):
            if o.requires_grad:
                o.register_hook(refuse)

    def refuse_pieces_given(self, module: nn.Module, inputs: Any) -> None:
        called = f"the call of {type(module).__name__} (a module) takes"
        for value in tree_flatten(inputs)[0]:
            if inspect.isgenerator(value) and value.gi_code.co_name in _PARAMETER_WALKS:
                raise ParameterReadError(
                    f"{self._context}: {called} a generator of parameters (`{value.gi_code.co_name}()`), and "
                    f"what it computes from them is not watched, while under this layout some parameters here are "
                    f"pieces of one process's. {_FIX}"
                )
        for t in tensors_in(inputs):
            label = self._labels.get(t)
            if label is not None and label.partial:
                self.refuse(label, f"{called} a tensor computed from")
            if label is not None and label.where == ParameterHere.TP_SUMMED and torch.is_grad_enabled():
                self._refuse_summed(label.name, f"{called} {label.name} with gradients on")

    def _refuse_summed(self, name: str, what: str) -> None:
        tp = self._map.sizes.get("tp")
        raise ParameterReadError(
            f"{self._context}: {name}: {what}, but under tp={tp} {name} is a replicated parameter whose gradient "
            f"each tp rank computes a part of and tp then sums over its ranks (sequence parallelism's norm weights, "
            f"per-head q/k norms), so a term every tp rank adds would count {tp} times. {_FIX}"
        )

    def refuse(self, label: Label, action: str) -> None:
        held = label.where.describe(self._map.sizes)
        raise ParameterReadError(
            f"{self._context}: {action} {label.name}, but on this rank {label.name} holds {held}, not the whole "
            f"parameter one process holds, so each rank gets a different number from one process's (a loss term "
            f"built from it is wrong in value, and in gradient unless it is a plain sum of per-element terms). {_FIX}"
        )

    def refuse_combined(self, label: Label, op: str) -> None:
        raise ParameterReadError(
            f"{self._context}: `{op}` combines several parameters ({self.names_shown(label)}), but under "
            f"pp={self._map.stages} the step on this rank sees only stage {self._map.stage}'s parameters "
            f"(self.parameters() lists only them), so the value leaves out the other stages'. {_FIX}"
        )


def refuse_averaging_callbacks(callbacks: list, layout: Any, zero: int) -> None:
    """Refuse Lightning's ``WeightAveraging`` (EMA) and ``StochasticWeightAveraging`` where a rank's
    module holds pieces of the parameters (tp, pp, ep > 1 or ZeRO-3). Called before the callbacks'
    ``setup``, which deep-copies the whole module.

    Those callbacks average a whole copy of the module, made before the strategy cuts it, parameter
    by parameter with the module's, paired by position. Under tp2 the first update failed inside
    torch's ``AveragedModel`` ("The size of tensor a (256) must match the size of tensor b (128)"),
    under pp2 on the last stage ("output with shape [64] doesn't match the broadcast shape [64,
    64]": the first stage's pairs happened to line up), under ZeRO-3 with "got mixed torch.Tensor
    and DTensor". Under dp (ZeRO-0/1/2) and cp every parameter is whole, and they train, validate
    and resume as one process does."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    found = sorted({type(c).__name__ for c in callbacks if isinstance(c, (WeightAveraging, StochasticWeightAveraging))})
    pieces = [
        f"tp={layout.tp} (each rank holds shards of the cut weights)" if layout.tp > 1 else "",
        f"pp={layout.pp} (each rank holds one stage's parameters)" if layout.pp > 1 else "",
        f"ep={layout.ep} (each rank holds its share of the routed experts)" if layout.ep > 1 else "",
        "zero=3 (each rank holds DTensor shards)" if zero == 3 else "",
    ]
    pieces = [p for p in pieces if p]
    if not found or not pieces:
        return
    raise ParameterReadError(
        f"{', '.join(found)} keeps a whole copy of the module, made before the strategy cuts it, and averages it "
        f"with the module parameter by parameter, but under {' and '.join(pieces)} the module on a rank no longer "
        f"holds one process's parameters: the callback would fail inside torch's AveragedModel at its first update, "
        f"or pair the wrong parameters. It trains, validates and resumes as one process does under data and "
        f"context parallelism (zero=0/1/2, cp), where every parameter is whole. Under this layout an average kept "
        f"element-wise on this rank's parameters is right (e.g. in on_train_batch_end: "
        f"ema.lerp_(p.detach(), 1 - decay) for each p in self.parameters(), then p.data.copy_(ema) at the end), "
        f"but it is not in the checkpoints."
    )
