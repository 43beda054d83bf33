"""How a value computed from a piece of a tensor is followed, and refused where it would combine elements.

Under the layouts a rank often holds a piece of what one process holds: a tp or expert shard of a
parameter or of its gradient, a ZeRO-1 buffer averaged only in this rank's chunk, only this
stage's parameters under pp. Element-wise work on a piece is right (each element is the one
process's element). A value that combines elements (a norm, a sum, a mean, a Python number) is
not: each rank gets a different, wrong number, and nothing says so.

:class:`PieceReads` is the shared part of the two watches (``gradient_reads`` for ``.grad`` in
the user's gradient hooks, ``parameter_reads`` for the parameters in the user's step): a
``TorchFunctionMode`` that keeps a :class:`Label` on every tensor computed from a labelled one
(also on a buffer written from one: ``flat[i:j] = g``, ``buf.copy_(g)``, and the buffer a view
belongs to), and refuses

* a reduction of a piece (an output with fewer elements than the labelled piece it read, or a
  Python number, array or verdict of it);
* under pp, a value combining two or more parameters' tensors (the other stages' are missing).

Each watch says what its pieces are, what the user can do instead, and where labels come from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

TO_PYTHON = frozenset(  # a number, array or verdict of the whole tensor, as Python sees it
    {"__float__", "__int__", "__bool__", "__index__", "__complex__", "item", "tolist", "numpy", "__array__", "equal",
     "allclose"}
)  # fmt: skip


@dataclass(frozen=True)
class Label:
    """What a tensor was computed from: the parameters (by one-process name), and whether any of
    them is a piece on this rank (``where``: the first piece's kind, else its watch's WHOLE)."""

    names: frozenset[str]
    where: Enum  # a watch's place enum: its members have ``piece`` (bool) and ``describe(sizes)``
    name: str  # the parameter the message names

    def join(self, other: "Label") -> "Label":
        keep = self if self.partial or not other.partial else other
        return Label(self.names | other.names, keep.where, keep.name)

    @property
    def partial(self) -> bool:
        return bool(self.where.piece)


def tensors_in(obj: Any) -> list[Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]


def remove_mode(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` off torch's function-mode stack wherever it is; the modes above it stay, in
    their order. False if it was not there."""
    if not any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
        return False
    above = []
    while torch.overrides._get_current_function_mode() is not mode:
        above.append(torch.overrides._pop_mode())
    torch.overrides._pop_mode()
    for m in reversed(above):
        torch.overrides._push_mode(m)
    return True


class PieceReads(TorchFunctionMode, ABC):
    """Labels flow from input to output; reductions of pieces, and under pp combinations of
    parameters, are refused (``refuse`` / ``refuse_combined``: the watch's own words).

    Subclasses label their sources (``intercept``: a call they answer themselves, or None) and
    may check a call before and after it runs (``before`` / ``after``)."""

    def __init__(self, labels: WeakIdKeyDictionary, stages: int, stage: int, context: str) -> None:
        super().__init__()
        self._labels, self._stages, self._stage, self._context = labels, stages, stage, context
        self._paused = 0

    @property
    def is_paused(self) -> bool:
        return self._paused > 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """This package's own code inside the watched region reads as it must."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -------------------------------------------------------------- what subclasses say
    def intercept(self, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, result) for a call the watch answers itself; (False, None) otherwise."""
        return False, None

    def meet(self, tensors: list[Tensor]) -> None:
        """The tensors a call takes, before their labels are looked up (a watch may label new ones)."""

    def before(self, name: str, label: Label, inputs: list[tuple[Tensor, Label]], args: tuple, kwargs: dict) -> None:
        """Checks of a call on labelled inputs before it runs."""

    def call(self, func, args: tuple, kwargs: dict, label: Label, inputs: list[tuple[Tensor, Label]]) -> Any:
        return func(*args, **kwargs)

    def after(self, out: Any, label: Label, inputs: list[tuple[Tensor, Label]]) -> None:
        """Checks of a call's output."""

    @abstractmethod
    def refuse(self, label: Label, action: str) -> None:
        """Raise: ``action`` is what the user's code did, e.g. "`norm` reduces a tensor computed from"."""

    @abstractmethod
    def refuse_combined(self, label: Label, op: str) -> None:
        """Raise: under pp, ``op`` combined the tensors of several parameters (``label.names``)."""

    # -------------------------------------------------------------- the flow
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        handled, result = self.intercept(func, args, kwargs)
        if handled:
            return result
        if func.__name__.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            return self._foreach(func, args, kwargs)
        tensors = tensors_in((args, kwargs))
        self.meet(tensors)
        inputs = [(t, self._labels[t]) for t in tensors if t in self._labels]
        if not inputs:
            return func(*args, **kwargs)
        label = inputs[0][1]
        for _, other in inputs[1:]:
            label = label.join(other)
        name = func.__name__
        self.before(name, label, inputs, args, kwargs)
        if name in TO_PYTHON and label.partial:
            self.refuse(label, f"`{name}()` makes a Python number of a tensor computed from")
        self._check_combined(label, name)
        out = self.call(func, args, kwargs, label, inputs)
        largest = max((t.numel() for t, lab in inputs if lab.partial), default=0)
        if any(o.numel() < largest for o in tensors_in(out)):
            self.refuse(label, f"`{name}` reduces a tensor computed from")
        self.after(out, label, inputs)
        written = []  # what an in-place op or an assignment (`flat[i:j] = g`) wrote into, and its base
        if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], Tensor):
            written = [args[0]] + ([args[0]._base] if args[0]._base is not None else [])
        for o in tensors_in(out) + written:
            self._labels[o] = label if o not in self._labels else self._labels[o].join(label)
        return out

    def _check_combined(self, label: Label, op: str) -> None:
        if self._stages > 1 and len(label.names) > 1:
            self.refuse_combined(label, op)

    def _foreach(self, func, args: tuple, kwargs: dict):
        """``torch._foreach_*`` ops: entry i of each list argument goes with entry i of the others."""
        lists = [a for a in args if isinstance(a, (list, tuple))]
        shared = [t for a in args if not isinstance(a, (list, tuple)) for t in tensors_in(a)] + tensors_in(kwargs)
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
                self._check_combined(label, func.__name__)
            entry_labels.append((label, largest))
        out = func(*args, **kwargs)
        if isinstance(out, (list, tuple)):
            for o, (label, largest) in zip(out, entry_labels):
                if label is None or not isinstance(o, Tensor):
                    continue
                if o.numel() < largest:
                    self.refuse(label, f"`{func.__name__}` reduces a tensor computed from")
                self._labels[o] = label
        return out

    def names_shown(self, label: Label) -> str:
        return ", ".join(sorted(label.names)[:3]) + (", ..." if len(label.names) > 3 else "")


@contextmanager
def unwatched() -> Iterator[None]:
    """Inside: no watch refuses a read. For this package's own reads inside a user's hook or step
    (the global-norm clipping, ``grad_norm``, the byte accounting, a backward or optimizer step
    run from a manual step): they know where each piece is."""
    with ExitStack() as stack:
        for mode in torch.overrides._get_current_function_mode_stack():
            if isinstance(mode, PieceReads):
                stack.enter_context(mode.paused())
        yield
