"""Position ranges a forward builds itself with ``torch.arange`` (rotary angles inside attention).

A hand-written model often numbers its tokens where it needs them::

    angles = torch.outer(torch.arange(s, device=x.device), inv_freq)      # s = x.shape[1]

in each attention's forward, or once at the top of the model. Under context parallelism ``s``
is the shard's length, so every rank would rotate its tokens as if they were 0..s−1. This
module names such a call by its **site** (the code object and the bytecode offset of the call,
so two ``arange`` calls on one line are two sites) and by its **scope** (the innermost module
whose ``forward`` was running), and replaces its result, while a sequence shard is current,
with the shard's global positions: ``arange(p, p + s)`` becomes ``p + positions`` (``p`` a
past length; zero in training), in the dtype and on the device the call asked for.

Which sites count is decided by :mod:`lightning_5d.plan.position_reads` on two probe lengths:
a site is a position range when every call of it gave ``start, start+1, ..., start+n−1`` for the
probe's length n on both probes. A site whose length stays the same on both probes (``arange(0,
d, 2)`` for the frequencies, ``arange(heads)``) does not depend on the positions and is left
alone; a site that follows the length some other way (``arange(2n)``, ``arange(0, n, 2)``) makes
the model "not observed". The token-wise proof then shows that the redirected sites are all
that carried the positions.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, ContextManager

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.config import LayoutError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class ArangeSiteError(LayoutError):
    """An observed position range was called in a way the probe did not show (the message says how)."""


@dataclass(frozen=True)
class ArangeSite:
    """One ``torch.arange`` call in the model's code: ``file:line`` in ``function``, at ``offset``
    (the call's bytecode offset; ``first_line`` tells functions of one name in one file apart)."""

    file: str
    function: str
    first_line: int
    offset: int
    line: int

    def describe(self) -> str:
        return f"arange at {os.path.basename(self.file)}:{self.line} ({self.function})"

    @property
    def key(self) -> tuple[str, str, int, int]:
        return self.file, self.function, self.first_line, self.offset


def caller_frame() -> FrameType | None:
    """The model's frame that called the torch function being handled: the first frame out of
    ``__torch_function__`` handlers (ours and any other mode's) and out of torch's own code."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_name == "__torch_function__" or frame.f_code.co_filename.startswith(_TORCH_DIR)
    ):
        frame = frame.f_back
    return frame


def site_of(frame: FrameType) -> ArangeSite:
    code = frame.f_code
    return ArangeSite(code.co_filename, code.co_name, code.co_firstlineno, frame.f_lasti, frame.f_lineno or 0)


def scope_of(frame: FrameType | None, modules: dict[int, str]) -> str | None:
    """Path of the innermost module (of ``modules``: id -> path) whose ``forward`` is running at ``frame``."""
    while frame is not None:
        if frame.f_code.co_name == "forward":
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in modules:
                return modules[id(owner)]
        frame = frame.f_back
    return None


def is_range_of(out: Tensor, n: int) -> bool:
    """``out`` is ``start, start+1, ..., start+n−1`` (a past length may shift it; zero on the probe)."""
    if out.dim() != 1 or out.numel() != n:
        return False
    return bool((out - out[:1] == torch.arange(n, device=out.device).to(out.dtype)).all())


# ------------------------------------------------------------------ redirecting


class SitesAt(TorchFunctionMode):
    """``torch.arange`` at one of ``sites`` returns ``start + positions()`` instead of ``start + arange(n)``.

    Acts only on calls of length ``positions().numel()`` (the shard's tokens); a call of another
    length at an observed site was not seen on the probe, so it is refused rather than left local.
    """

    def __init__(self, sites: frozenset[tuple[str, str, int, int]], positions: Tensor, where: str) -> None:
        super().__init__()
        self.sites, self.positions, self.where = sites, positions, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not torch.arange:
            return out
        frame = caller_frame()
        if frame is None or site_of(frame).key not in self.sites:
            return out
        n = self.positions.numel()
        if out.dim() != 1 or out.numel() != n:
            site = site_of(frame)
            raise ArangeSiteError(
                f"{site.describe()} in {self.where} was observed to number the sequence's tokens, but here it made "
                f"{out.numel()} values where this rank holds {n} tokens. Take a position_ids argument in the model's "
                f"forward and build the rotary angles from it (the strategy then hands in each shard's global "
                f"positions), or use cp=1."
            )
        return self.positions.to(device=out.device, dtype=out.dtype) + out[:1]


def redirected_forward(
    positions: Callable[[], Tensor | None], redirect: Callable[[Tensor], ContextManager[Any]]
) -> Callable[..., Any]:
    """A forward wrapper (``sharded(original, *args, **kwargs)``) that runs the forward inside
    ``redirect(the shard's positions)`` while a shard is current, and unchanged otherwise."""

    def sharded(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        given = positions()
        if given is None:
            return original(*args, **kwargs)
        with redirect(given):
            return original(*args, **kwargs)

    return sharded


def sites_forward(
    sites: frozenset[tuple[str, str, int, int]], positions: Callable[[], Tensor | None], where: str
) -> Callable[..., Any]:
    """A forward wrapper that redirects ``sites`` while it runs."""
    return redirected_forward(positions, lambda given: SitesAt(sites, given, where))


def module_paths(root: nn.Module) -> dict[int, str]:
    return {id(m): path for path, m in root.named_modules()}
