"""Which ``torch.arange`` outputs of a probe forward reach its output, other than through an ALiBi mask.

A model that numbers its tokens itself (``arange(n)``) must, under context parallelism, see
each token's global position wherever that number matters. One use needs nothing from the
model: an attention bias proven to be slopes times token distances
(:func:`lightning_5d.plan.linear_bias.read_linear_bias`), which ring attention rebuilds from
global positions itself. This mode follows every value computed from each arange through
the forward (any op with such an input makes its outputs carry the arange's label; in-place
ops and ``x[i] = y`` mark the tensor written to) and stops the flow at the ``attn_mask`` of an
``F.scaled_dot_product_attention`` call when that mask is a proven linear bias. An arange whose
label is not on the forward's output then influences it only through such masks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_5d.plan.linear_bias import read_linear_bias

__all__ = ["ArangeFlow"]

_SDPA_MASK = 3  # attn_mask's position in F.scaled_dot_product_attention(query, key, value, attn_mask, ...)


class ArangeFlow(TorchFunctionMode):
    """Labels each arange output (its index in :attr:`aranges`) and every value computed from it."""

    def __init__(self) -> None:
        super().__init__()
        self.aranges: list[Tensor] = []
        self._labels: dict[int, frozenset[int]] = {}
        self._held: list[Tensor] = []  # keeps labelled tensors alive, so their ids are not reused

    def labels(self, value: Any) -> frozenset[int]:
        """The aranges whose values flowed into ``value`` (any nesting of tensors)."""
        found: frozenset[int] = frozenset()
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor):
                found = found | self._labels.get(id(leaf), frozenset())
        return found

    def _mark(self, value: Any, labels: frozenset[int]) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor):
                self._labels[id(leaf)] = self._labels.get(id(leaf), frozenset()) | labels
                self._held.append(leaf)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.arange:
            self._mark(out, frozenset({len(self.aranges)}))
            self.aranges.append(out)
            return out
        inputs: Any = (args, kwargs)
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[_SDPA_MASK] if len(args) > _SDPA_MASK else None)
            if read_linear_bias(mask) is not None:  # rebuilt from global positions under cp
                inputs = ([a for a in args if a is not mask], {k: v for k, v in kwargs.items() if v is not mask})
        labels = self.labels(inputs)
        if labels:
            self._mark(out, labels)
            if _in_place(getattr(func, "__name__", "")) and args and isinstance(args[0], Tensor):
                self._mark(args[0], labels)  # written in place
        return out


_AUGMENTED = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul"}


def _in_place(name: str) -> bool:
    """``x.add_(y)``, ``x += y``, ``x[i] = y``: ops that write into their first argument."""
    if name.startswith("__") and name.endswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name[3:-2] in _AUGMENTED)
    return name.endswith("_")
