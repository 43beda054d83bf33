"""What a user's hooks read of the gradients, checked against what one process would read.

In one process, ``p.grad`` of every parameter is its whole gradient when ``on_after_backward``,
``on_before_optimizer_step`` and ``configure_gradient_clipping`` run, and users compute with
it there: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)``, Lightning's
``grad_norm(self, 2)`` logged for monitoring, a finiteness check. Under the layouts a rank's
``.grad`` is often something else (:class:`GradientHere`): a tp shard, a ZeRO-1 buffer of which
only this rank's chunk is reduced over the data ranks, ``None`` (ZeRO-2 keeps only the
optimizer's slice), or a partial sum that tp adds up later; under pp the other stages'
parameters are not on this rank at all. Element-wise work (clipping by value, scaling by a
factor every rank agrees on) is right on any piece. What goes wrong is a value that combines
elements: each rank computes a different norm, clips by it, and the ranks' replicated
parameters drift apart, without a word (measured on the reference model after 3 steps,
clipping to 0.05: 2.6e-2 relative error under tp2, 6.7e-3 under pp2, 5.7e-3 under cp2).

:class:`GradientReads` watches the user's gradient hooks (a ``TorchFunctionMode`` active only
while they run): a ``.grad`` read of a parameter whose gradient here is not the whole one
labels the tensor it returns, every tensor computed from a labelled one carries the label, and

* a reduction of a labelled tensor (an output with fewer elements than the labelled input, or a
  Python number) is refused, naming the parameter, what its ``.grad`` holds on this rank and
  what gives the one-process value (``Trainer(gradient_clip_val=)``, ``self.clip_gradients``,
  :func:`lightning_5d.grad_norm`);
* a ``.grad`` read that finds ``None`` where the gradient lives in the optimizer's slice is
  refused (one process would have found it: a loop over ``if p.grad is not None`` silently
  skips it);
* under pp, a value combining the gradients of two or more parameters is refused: the other
  stages' parameters are missing from it.

A gradient that is ``None`` here because the optimizer's parameter holds it whole (the precision
plugin's fp32 master, moved there before ``on_before_optimizer_step``; ZeRO-2's slice when one
rank holds every slice) is read from there instead: the same numbers, and what the user writes
into it reaches the optimizer.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# Hooks that run between the backward and the optimizer step, with the gradients in hand.
MODULE_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")
_FROM_VALUES = frozenset({"tensor", "as_tensor"})  # torch.tensor([...]): reads each element's value
_TO_PYTHON = frozenset(  # a number or verdict of the whole tensor, as Python sees it
    {"__float__", "__int__", "__bool__", "__index__", "__complex__", "item", "tolist", "numpy", "equal", "allclose"}
)
_FIX = (
    "For clipping use Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, gradient_clip_val=..., "
    "gradient_clip_algorithm='norm'), which clip by the global norm under every layout; for norms to log use "
    "lightning_5d.grad_norm(self, norm_type), the one-process values on every rank. Element-wise work on "
    "p.grad (clipping by value, scaling by a factor every rank agrees on) is fine."
)


class GradientReadError(RuntimeError):
    """A hook computed a value from gradients that on this rank are not what one process holds."""


class GradientHere(Enum):
    """What a parameter's ``.grad`` holds on this rank when the user's gradient hooks run."""

    WHOLE = "whole"  # the one-process gradient (also a ZeRO-3 DTensor: its ops see the whole)
    TP_SHARD = "tp_shard"  # 1/tp of it, cut like the parameter
    EXPERT_SHARD = "expert_shard"  # this ep rank's experts of a stacked expert parameter
    DATA_SLICE = "data_slice"  # ZeRO-1/2: reduced only in this rank's chunk, or None (in the optimizer)
    TP_PARTIAL = "tp_partial"  # SP norm weights under ZeRO-3 before their sum over tp

    def describe(self, sizes: Mapping[str, int]) -> str:
        """What ``.grad`` holds, as a noun phrase."""
        slices = sizes.get("slices")
        return {
            GradientHere.TP_SHARD: f"its tensor-parallel shard (1/{sizes.get('tp')} of the gradient)",
            GradientHere.EXPERT_SHARD: f"only this ep rank's experts (1/{sizes.get('ep')} of them)",
            GradientHere.DATA_SLICE: f"a buffer averaged over the data ranks only in this rank's 1/{slices} chunk (zero=1)",
            GradientHere.TP_PARTIAL: "this rank's partial sum, which tp adds over its ranks after on_after_backward",
        }.get(self, "the whole gradient")


@dataclass(frozen=True)
class _Label:
    names: frozenset[str]
    where: GradientHere  # WHOLE unless a source is a piece (the first such source's kind)
    name: str  # the parameter the message names

    def join(self, other: "_Label") -> "_Label":
        mine = self.where != GradientHere.WHOLE
        keep = self if mine or other.where == GradientHere.WHOLE else other
        return _Label(self.names | other.names, keep.where, keep.name)

    @property
    def partial(self) -> bool:
        return self.where != GradientHere.WHOLE


@dataclass(frozen=True)
class GradientMap:
    """Where each parameter's gradient is, by name (the same on every hook call of a fit).

    ``grad_elsewhere``: parameter name -> (its gradient where the optimizer holds it, whether that
    is the whole gradient shaped as the parameter), or None where it holds none: a precision
    plugin's fp32 master, or a ZeRO slice of one shard rank, is whole and read in place of a
    ``None`` ``.grad``; a slice of several is not, and a ``None`` ``.grad`` is then refused.
    ``stage``: this rank's pipeline stage of ``stages`` (1: no pp); ``tp_partial_until_synced``:
    names whose gradient tp sums only after ``on_after_backward``."""

    where: Mapping[str, GradientHere]
    sizes: Mapping[str, int]
    grad_elsewhere: Callable[[str], "tuple[Tensor, bool] | None"] = lambda name: None
    stage: int = 0
    stages: int = 1
    tp_partial_until_synced: frozenset[str] = frozenset()
    dtensor_grads: bool = False  # ZeRO-3: gradients are DTensors (whole to their ops, not to torch.tensor)
    moved_out: bool = False  # gradients move into fp32 masters or whole ZeRO slices (read from there)

    @property
    def needed(self) -> bool:
        """Whether any read could differ from one process's (otherwise no hook is watched)."""
        pieces = any(w != GradientHere.WHOLE for w in self.where.values())
        late = bool(self.tp_partial_until_synced)
        return self.stages > 1 or pieces or late or self.dtensor_grads or self.moved_out


def _tensors(obj: Any) -> list[Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]


class GradientReads(TorchFunctionMode):
    """The mode of one hook call: labels what ``.grad`` reads return and refuses what they must not feed."""

    def __init__(self, grads: GradientMap, parameters: Mapping[int, str], hook: str) -> None:
        super().__init__()
        self._map, self._names, self._hook = grads, parameters, hook
        self._labels: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._paused = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The strategy's own code inside a hook (its global-norm clipping) reads gradients as it must."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch._C.TensorBase.grad and func.__name__ == "__get__":
            return self._read_grad(args[0], func(*args, **kwargs))
        if func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            return self._foreach(func, args, kwargs)
        inputs = [(t, self._labels[t]) for t in _tensors((args, kwargs)) if t in self._labels]
        if not inputs:
            return func(*args, **kwargs)
        label = inputs[0][1]
        for _, other in inputs[1:]:
            label = label.join(other)
        name = func.__name__
        if name in _FROM_VALUES and any(isinstance(t, DTensor) for t, _ in inputs):
            raise GradientReadError(
                f"{self._hook}: torch.{name}() of values computed from {label.name}.grad, which is a DTensor under "
                f"zero=3 (each rank holds a shard; its norm is a DTensor too): torch cannot read a DTensor's value "
                f"into a new tensor (it fails with 'data is not allocated yet'), as Lightning's grad_norm does. {_FIX}"
            )
        if name in _TO_PYTHON and label.partial:
            self._refuse(label, f"`{name}()` makes a Python number of a tensor computed from")
        self._refuse_combined(label, name)
        out = func(*args, **kwargs)
        largest = max((t.numel() for t, lab in inputs if lab.partial), default=0)
        if any(o.numel() < largest for o in _tensors(out)):
            self._refuse(label, f"`{name}` reduces a tensor computed from")
        for o in _tensors(out):
            self._labels[o] = label
        return out

    def _read_grad(self, param: Tensor, grad: Tensor | None) -> Tensor | None:
        name = self._names.get(id(param))
        if name is None:
            return grad
        where = self._map.where.get(name, GradientHere.WHOLE)
        if grad is None:
            elsewhere, whole = self._map.grad_elsewhere(name) or (None, False)
            if elsewhere is None:
                return grad  # no gradient anywhere: None in one process too
            if not whole:
                self._refuse_none(name)
            grad = elsewhere  # moved into the fp32 master / ZeRO's whole slice: the same numbers
        if name in self._map.tp_partial_until_synced and self._hook.endswith("on_after_backward"):
            where = GradientHere.TP_PARTIAL
        self._labels[grad] = _Label(frozenset({name}), where, name)
        return grad

    def _foreach(self, func, args: tuple, kwargs: dict):
        """``torch._foreach_*`` ops: entry i of each list argument goes with entry i of the others."""
        lists = [a for a in args if isinstance(a, (list, tuple))]
        shared = [t for a in args if not isinstance(a, (list, tuple)) for t in _tensors(a)] + _tensors(kwargs)
        shared_label = None
        for t in shared:
            if t in self._labels:
                shared_label = self._labels[t] if shared_label is None else shared_label.join(self._labels[t])
        entry_labels = []
        for i in range(len(lists[0])):
            label = shared_label
            largest = 0
            for entries in lists:
                t = entries[i] if i < len(entries) else None
                if isinstance(t, Tensor) and t in self._labels:
                    label = self._labels[t] if label is None else label.join(self._labels[t])
                    if self._labels[t].partial:
                        largest = max(largest, t.numel())
            if label is not None:
                self._refuse_combined(label, func.__name__)
            entry_labels.append((label, largest))
        out = func(*args, **kwargs)
        if isinstance(out, (list, tuple)):
            for o, (label, largest) in zip(out, entry_labels):
                if label is None or not isinstance(o, Tensor):
                    continue
                if o.numel() < largest:
                    self._refuse(label, f"`{func.__name__}` reduces a tensor computed from")
                self._labels[o] = label
        return out

    def _refuse_combined(self, label: _Label, op: str) -> None:
        if self._map.stages > 1 and len(label.names) > 1:
            shown = ", ".join(sorted(label.names)[:3]) + (", ..." if len(label.names) > 3 else "")
            raise GradientReadError(
                f"{self._hook}: {op} combines the gradients of several parameters ({shown}), but under "
                f"pp={self._map.stages} this rank holds only stage {self._map.stage}'s parameters, so the value "
                f"leaves out the other stages' (a total norm would be this stage's, and clipping by it would "
                f"scale each stage differently). {_FIX}"
            )

    def _refuse(self, label: _Label, action: str) -> None:
        """``action``: what the hook did, e.g. "`norm` reduces a tensor computed from"."""
        held = label.where.describe(self._map.sizes)
        raise GradientReadError(
            f"{self._hook}: {action} {label.name}.grad, but on this rank {label.name}.grad holds {held}, not the "
            f"whole gradient one process holds, so each rank would get a different, wrong number. {_FIX}"
        )

    def _refuse_none(self, name: str) -> None:
        sizes = self._map.sizes
        raise GradientReadError(
            f"{self._hook}: {name}.grad is None on this rank, where one process holds the gradient (a loop over "
            f"`if p.grad is not None` would silently leave it out): under zero={sizes.get('zero')} the gradient "
            f"averaged over the data ranks exists only as each rank's 1/{sizes.get('slices')} slice, the "
            f"optimizer's parameter. {_FIX}"
        )


@contextmanager
def unwatched() -> Iterator[None]:
    """Inside: no watch refuses a read. For this package's own reads of gradients inside a user's
    hook (the global-norm clipping, ``grad_norm``, the byte accounting): they know where each
    gradient is."""
    with ExitStack() as stack:
        for mode in torch.overrides._get_current_function_mode_stack():
            if isinstance(mode, GradientReads):
                stack.enter_context(mode.paused())
        yield


class ManualWindow:
    """Manual optimization: the user's ``training_step`` between ``self.manual_backward(loss)`` and
    ``opt.step()`` (or the step's end) is watched too; there users clip by hand.

    Not a ``with`` block: it opens when a backward returns to the user's step and closes at the
    next backward (whose own reads are the strategy's), the optimizer step, or the step's end."""

    def __init__(self) -> None:
        self._mode: GradientReads | None = None

    def open(self, grads: GradientMap, root: nn.Module, hook: str) -> None:
        self.close()
        if grads.needed:
            self._mode = GradientReads(grads, {id(p): n for n, p in root.named_parameters()}, hook)
            self._mode.__enter__()

    def close(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if torch.overrides._get_current_function_mode() is mode:
            mode.__exit__(None, None, None)
        else:  # a mode the user's step left open sits above it: silence it rather than pop another
            mode._paused += 1


@contextmanager
def watching(grads: GradientMap, root: nn.Module, hook: str) -> Iterator[GradientReads]:
    """Inside: ``hook``'s reads of ``root``'s parameters' gradients are watched."""
    names = {id(p): n for n, p in root.named_parameters()}
    with GradientReads(grads, names, hook) as mode:
        yield mode


def watch_hooks(
    grads: GradientMap, root: nn.Module, owners: Iterable[tuple[Any, Iterable[str], str]]
) -> Callable[[], None]:
    """Each ``owner``'s hooks (``(object, hook names, label)``) run watched; returns the undo.

    Instance attributes shadow the class's methods, as the step regions do (``step_log.shadowed``)."""
    undo: list[Callable[[], None]] = []
    for owner, hooks, label in owners:
        for hook in hooks:
            if not callable(getattr(owner, hook, None)):
                continue
            own = vars(owner).get(hook)
            undo.append(_restore(owner, hook, own))
            setattr(owner, hook, _watched(getattr(owner, hook), grads, root, f"{label}.{hook}"))

    def remove() -> None:
        for u in reversed(undo):
            u()

    return remove


def _restore(owner: Any, hook: str, own: Any) -> Callable[[], None]:
    def put_back() -> None:
        if own is None:
            vars(owner).pop(hook, None)
        else:
            setattr(owner, hook, own)

    return put_back


def _watched(method: Callable, grads: GradientMap, root: nn.Module, hook: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        with watching(grads, root, hook):
            return method(*args, **kwargs)

    run.__wrapped__ = method  # type: ignore[attr-defined]
    return run
