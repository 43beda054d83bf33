"""Putting another ``forward`` on a module for a while, and exactly the old one back."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Set ``forward`` as ``module``'s instance attribute; the returned function undoes it.

    The undo puts back what the instance held: a forward of its own that someone set before
    (another wrapper, stacked), or none, so the class's method shows through again. Undoing in
    the reverse order of replacing unstacks wrappers cleanly.
    """
    had_own = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            vars(module).pop("forward", None)

    return undo
