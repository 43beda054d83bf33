"""Running a model in eval mode for a while and giving every module its own mode back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(root: nn.Module) -> Iterator[None]:
    """``root`` in eval mode (dropout off, so probes and comparisons are deterministic); on exit
    each module gets back the mode it had, which may differ between modules (a frozen
    submodule a user keeps in eval mode stays there)."""
    modes = {m: m.training for m in root.modules()}
    root.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training
