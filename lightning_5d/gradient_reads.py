"""What a user's hooks read of the gradients, checked against what one process would read.

In one process, ``p.grad`` of every parameter is its whole gradient when ``on_after_backward``,
``on_before_optimizer_step``, ``configure_gradient_clipping`` and ``on_before_zero_grad`` run,
and users compute with it there: ``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)``,
Lightning's ``grad_norm(self, 2)`` logged for monitoring, a finiteness check. Under the layouts a
rank's ``.grad`` is often something else (``gradient_places``): a tp or expert shard, a ZeRO-1
buffer of which only this rank's chunk is the averaged gradient, ``None`` or this rank's own
unreduced gradient (the averaged one lives in the optimizer's slices), or a partial sum that tp
adds up later; under pp the other stages' parameters are not on this rank at all. Element-wise
work (clipping by value, scaling by a factor every rank agrees on) is right on a piece. What
goes wrong is a value that combines elements: each rank computes a different norm, clips by it,
and the ranks' replicated parameters drift apart, without a word (the reference model after 2
steps, clipping to 0.05: 1.5e-3 relative parameter error under tp2, 3.6e-4 under pp2, 7.0e-4
under cp2; benchmarks/RESULTS.md "training_patterns").

:class:`GradientReads` watches the user's gradient hooks (a ``TorchFunctionMode`` active only
while they run; under manual optimization also the step from ``manual_backward`` to
``opt.step()``: :class:`ManualWindow`). A ``.grad`` read of a parameter whose gradient here is a
piece labels the tensor it returns; every tensor computed from a labelled one, or written into
(``flat[i:j] = g``, ``buf.copy_(g)``, and the buffer a view belongs to), carries the label, for
the rest of the fit's hooks (:class:`GradientWatch`). Then

* a reduction of a labelled tensor (an output with fewer elements than the labelled input, or a
  Python number, array or verdict) is refused, naming the parameter, what its ``.grad`` holds on
  this rank and what gives the one-process value (``Trainer(gradient_clip_val=)``,
  ``self.clip_gradients``, :func:`lightning_5d.grad_norm`);
* a ``.grad`` read that finds nothing one process would find (``None``, or this rank's own
  unreduced gradient, where the averaged one lives only in the optimizer's slices) is refused at
  the read: a loop over ``if p.grad is not None`` would skip it, a value written would be lost;
* under pp, a value combining the gradients of two or more parameters is refused: the other
  stages' parameters are missing from it;
* under ZeRO-3, ``torch.tensor()`` of DTensor values (Lightning's ``grad_norm`` total) is refused
  with the fix instead of torch's "data is not allocated yet".

A gradient the optimizer's parameter holds whole (the precision plugin's fp32 master, moved there
before ``on_before_optimizer_step``; a ZeRO slice when one rank holds every slice) is read from
there instead: the same numbers, and what the user writes into it reaches the optimizer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from lightning_5d.piece_reads import Label, PieceReads, remove_mode

# Hooks that run between the backward and the optimizer step, with the gradients in hand.
MODULE_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "on_before_zero_grad")
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")
_FROM_VALUES = frozenset({"tensor", "as_tensor"})  # torch.tensor([...]): reads each element's value
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

    @property
    def piece(self) -> bool:
        return self != GradientHere.WHOLE

    def describe(self, sizes: Mapping[str, int]) -> str:
        """What ``.grad`` holds, as a noun phrase."""
        slices = sizes.get("slices")
        return {
            GradientHere.TP_SHARD: f"its tensor-parallel shard (1/{sizes.get('tp')} of the gradient)",
            GradientHere.EXPERT_SHARD: f"only this ep rank's experts (1/{sizes.get('ep')} of them)",
            GradientHere.DATA_SLICE: (
                f"a buffer averaged over the data ranks only in this rank's 1/{slices} chunk (zero=1)"
            ),
            GradientHere.TP_PARTIAL: "this rank's partial sum, which tp adds over its ranks after on_after_backward",
        }.get(self, "the whole gradient")


class Found(Enum):
    """Where a ``.grad`` read finds the gradient one process would find (``GradientMap.locate``)."""

    READ = "read"  # in .grad itself (whole, or a piece the label says)
    SUBSTITUTE = "substitute"  # whole, in the optimizer's parameter (fp32 master, a ZeRO slice of one rank)
    ELSEWHERE = "elsewhere"  # only in the optimizer's slices: .grad holds nothing one process would


@dataclass(frozen=True)
class GradientMap:
    """Where each parameter's gradient is, by name (the same on every hook call of a fit).

    ``locate(name, grad)``: what a read of that parameter's ``.grad`` (``grad``) stands for now
    (:class:`Found`, and the tensor to hand back): the optimizer's parameter holds the gradient
    once ZeRO-1/2 reduced it (its slice; whole with one shard rank) or the precision plugin
    moved it (the fp32 master). ``tp_partial(name)``: whether that gradient is, right now, a
    partial sum tp adds up later (SP norm weights under ZeRO-3, until the step's sum).
    ``stage``: this rank's pipeline stage of ``stages`` (1: no pp)."""

    where: Mapping[str, GradientHere]
    sizes: Mapping[str, int]
    locate: Callable[[str, "Tensor | None"], "tuple[Found, Tensor | None]"] = lambda name, grad: (Found.READ, grad)
    tp_partial: Callable[[str], bool] = lambda name: False
    stage: int = 0
    stages: int = 1
    tp_sums_late: bool = False  # some gradients are summed over tp only after on_after_backward
    dtensor_grads: bool = False  # ZeRO-3: gradients are DTensors (whole to their ops, not to torch.tensor)
    moved_out: bool = False  # gradients move into the optimizer's parameters (read from there)

    @property
    def needed(self) -> bool:
        """Whether any read could differ from one process's (otherwise no hook is watched)."""
        pieces = any(w != GradientHere.WHOLE for w in self.where.values())
        return self.stages > 1 or pieces or self.tp_sums_late or self.dtensor_grads or self.moved_out


class GradientWatch:
    """One fit's watch: the map, and the labels of what hooks read, kept across hook calls (a copy
    taken in ``on_after_backward`` and reduced in ``on_before_optimizer_step`` is still a piece)."""

    def __init__(self, grads: GradientMap) -> None:
        self.map = grads
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weak: a label dies with its tensor

    def mode(self, root: nn.Module, hook: str) -> "GradientReads":
        return GradientReads(self, {id(p): n for n, p in root.named_parameters()}, hook)


class GradientReads(PieceReads):
    """The mode of one hook call: labels what ``.grad`` reads return and refuses what they must not feed."""

    def __init__(self, watch: GradientWatch, parameters: Mapping[int, str], hook: str) -> None:
        super().__init__(watch.labels, watch.map.stages, watch.map.stage, hook)
        self._map, self._names, self._hook = watch.map, parameters, hook

    def intercept(self, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        if getattr(func, "__self__", None) is torch._C.TensorBase.grad and func.__name__ == "__get__":
            return True, self._read_grad(args[0], func(*args, **kwargs))
        return False, None

    def before(self, name: str, label: Label, inputs: list[tuple[Tensor, Label]], args: tuple, kwargs: dict) -> None:
        if name in _FROM_VALUES and any(isinstance(t, DTensor) for t, _ in inputs):
            raise GradientReadError(
                f"{self._hook}: torch.{name}() of values computed from {label.name}.grad, which is a DTensor under "
                f"zero=3 (each rank holds a shard; its norm is a DTensor too): torch cannot read a DTensor's value "
                f"into a new tensor (it fails with 'data is not allocated yet'), as Lightning's grad_norm does. {_FIX}"
            )

    def _read_grad(self, param: Tensor, grad: Tensor | None) -> Tensor | None:
        name = self._names.get(id(param))
        if name is None:
            return grad
        where = self._map.where.get(name, GradientHere.WHOLE)
        read = grad
        found, grad = self._map.locate(name, grad)
        if found == Found.ELSEWHERE:
            self._refuse_elsewhere(name, read is None)
        if grad is None:
            return grad  # no gradient anywhere: None in one process too
        if self._map.tp_partial(name):
            where = GradientHere.TP_PARTIAL
        self._labels[grad] = Label(frozenset({name}), where, name)
        return grad

    def refuse_combined(self, label: Label, op: str) -> None:
        raise GradientReadError(
            f"{self._hook}: {op} combines the gradients of several parameters ({self.names_shown(label)}), but "
            f"under pp={self._map.stages} this rank holds only stage {self._map.stage}'s parameters, so the value "
            f"leaves out the other stages' (a total norm would be this stage's, and clipping by it would scale "
            f"each stage differently). {_FIX}"
        )

    def refuse(self, label: Label, action: str) -> None:
        held = label.where.describe(self._map.sizes)
        raise GradientReadError(
            f"{self._hook}: {action} {label.name}.grad, but on this rank {label.name}.grad holds {held}, not the "
            f"whole gradient one process holds, so each rank would get a different, wrong number. {_FIX}"
        )

    def _refuse_elsewhere(self, name: str, none: bool) -> None:
        held = (
            "is None on this rank (a loop over `if p.grad is not None` would silently leave it out)"
            if none
            else "holds this rank's own, unreduced gradient (what is written into it never reaches the optimizer)"
        )
        raise GradientReadError(
            f"{self._hook}: {name}.grad {held}, where one process holds the gradient: under "
            f"zero={self._map.sizes.get('zero')} the gradient averaged over the data ranks exists only as the "
            f"optimizer's slices of it, one per data rank. {_FIX}"
        )


class ManualWindow:
    """Manual optimization: the user's ``training_step`` between ``self.manual_backward(loss)`` and
    ``opt.step()`` (or the step's end) is watched too; there users clip by hand.

    Not a ``with`` block: it opens when a backward returns to the user's step and closes at the
    next backward (whose own reads are the strategy's), the optimizer step, or the step's end."""

    def __init__(self) -> None:
        self._mode: GradientReads | None = None

    def open(self, watch: GradientWatch, root: nn.Module, hook: str) -> None:
        self.close()
        if watch.map.needed:
            self._mode = watch.mode(root, hook)
            self._mode.__enter__()

    def close(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:  # modes entered after it (and not left yet) stay, in their order
            remove_mode(mode)


@contextmanager
def watching(watch: GradientWatch, root: nn.Module, hook: str) -> Iterator[GradientReads]:
    """Inside: ``hook``'s reads of ``root``'s parameters' gradients are watched."""
    with watch.mode(root, hook) as mode:
        yield mode


def watch_hooks(
    watch: GradientWatch, root: nn.Module, owners: Iterable[tuple[Any, Iterable[str], str]]
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
            setattr(owner, hook, _watched(getattr(owner, hook), watch, root, f"{label}.{hook}"))

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


def _watched(method: Callable, watch: GradientWatch, root: nn.Module, hook: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        with watching(watch, root, hook):
            return method(*args, **kwargs)

    run.__wrapped__ = method  # type: ignore[attr-defined]
    return run
