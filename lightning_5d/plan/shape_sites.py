"""Where an attention forward reshapes with a full head count or width, observed at full size.

nanoGPT-style attention reads its widths from the input (``B, T, C = x.size()``) and from
the config (``split(self.n_embd, dim=2)``, ``view(B, T, self.n_head, C // self.n_head)``,
``view(B, T, C)``). Under tensor parallelism the fused projection's output is the rank's
``3 * C / tp`` features and the heads are ``n_head / tp``, but ``C`` is still the full input
width: dividing attributes cannot fix a width read from a tensor. What can: knowing, for
each reshape call in the forward, which of its size arguments are the model's constants
(the same for every batch) and which of those are a full head count or width.

So discovery runs the model twice on token ids of two shapes (batch and sequence both
differ) with a ``TorchFunctionMode`` inside each attention module's forward, and records
every ``view`` / ``reshape`` / ``split`` call by its place in the model's code (file, line,
and the how-many-th call from that line within one forward). A size argument equal in both
runs is a constant; a constant equal to the full query/kv head count or the full query/kv
width is one tensor parallelism divides by tp. Only calls with such a constant are kept
(:class:`ShapeSite`); :mod:`lightning_5d.parallel.tensor.local_shapes` replays them under tp.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.forward_patch import replace_forward
from lightning_5d.plan import paths
from lightning_5d.plan.model_plan import AttentionPlan, ModelPlan

# Two probe shapes whose batch and sequence sizes both differ (and differ from small head counts).
PROBE_SHAPES = ((2, 16), (3, 24))
SHAPE_OPS: dict[Any, str] = {
    Tensor.view: "view",
    Tensor.reshape: "reshape",
    torch.reshape: "reshape",
    Tensor.split: "split",
    torch.split: "split",
}
_TORCH_DIR = os.path.dirname(torch.__file__)
# Our own frames between the model's call and the mode: this file and the one replaying the sites.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (os.path.abspath(__file__), os.path.join(_PACKAGE, "parallel", "tensor", "local_shapes.py"))


@dataclass(frozen=True)
class ShapeSite:
    """One size-taking call inside an attention forward, as observed at full size.

    ``key``: (file, line, n): the n-th call from that line of the model's code in one forward.
    ``sizes``: the call's sizes (``view``/``reshape``: the shape; ``split``: the split size or
    sections), None where they changed with the batch. ``divided``: which of them are a full
    head count or width. ``pieces``: how many tensors a ``split`` returned (0 otherwise).
    """

    key: tuple[str, int, int]
    op: str
    sizes: tuple[int | None, ...]
    divided: tuple[bool, ...]
    pieces: int = 0

    def local_sizes(self, runtime: tuple[int, ...], tp: int) -> tuple[int, ...]:
        """``runtime`` with every constant set to its tp-local value (the batch-shaped ones kept)."""
        return tuple(
            got if full is None else (full // tp if cut else full)
            for got, full, cut in zip(runtime, self.sizes, self.divided)
        )


def shape_call(func: Any, args: tuple, kwargs: dict) -> tuple[str, tuple[int, ...]] | None:
    """(op, sizes) of a view/reshape/split call, or None for any other call (or a dtype view)."""
    op = SHAPE_OPS.get(func)
    if op is None or len(args) < 2:
        return None
    rest = args[1:]
    if op == "split":
        sizes = rest[0]
        sizes = (sizes,) if isinstance(sizes, int) else tuple(sizes) if isinstance(sizes, (list, tuple)) else None
    elif len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        sizes = tuple(rest[0])
    else:
        sizes = tuple(rest)
    if sizes is None or not sizes or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        return None
    return op, sizes


def with_sizes(op: str, args: tuple, sizes: tuple[int, ...]) -> tuple:
    """``args`` of the call with ``sizes`` in place of its own."""
    if op == "split":
        first = sizes[0] if isinstance(args[1], int) else list(sizes)
        return (args[0], first, *args[2:])
    return (args[0], *sizes)


def call_site() -> tuple[str, int]:
    """(file, line) of the nearest frame outside torch and lightning_5d: the model's own code."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name in _OURS):
            return name, frame.f_lineno
        frame = frame.f_back
    return "", 0


class SiteCounter:
    """Keys calls by (file, line, n-th call from that line in this forward)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], int] = {}

    def key(self) -> tuple[str, int, int]:
        where = call_site()
        n = self.seen.get(where, 0)
        self.seen[where] = n + 1
        return (*where, n)


class _Record(TorchFunctionMode):
    """Every shape call of one attention forward: key -> (op, sizes, number of outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple[str, int, int], tuple[str, tuple[int, ...], int]] = {}
        self.counter = SiteCounter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        found = shape_call(func, args, kwargs or {})
        if found is not None:
            pieces = len(out) if found[0] == "split" else 0
            self.calls[self.counter.key()] = (*found, pieces)
        return out


def observe_sites(root: nn.Module, plan: ModelPlan, run: Callable[[tuple[int, int]], bool]) -> ModelPlan:
    """``plan`` with each attention's :class:`ShapeSite` list; ``run(shape)`` runs the model on
    token ids of ``shape`` and says whether it ran."""
    targets = {
        i: b.attention for i, b in enumerate(plan.block_plans) if b.attention is not None and _eligible(b.attention)
    }
    if not targets:
        return plan
    runs: list[dict[int, dict]] = []
    for shape in PROBE_SHAPES:
        records: dict[int, dict] = {}
        with _recording(root, plan, targets, records), torch.no_grad():
            if not run(shape):
                return plan
        runs.append(records)
    blocks = list(plan.block_plans)
    for i, att in targets.items():
        first, second = runs[0].get(i), runs[1].get(i)
        if first is None or second is None:
            continue
        sites = _sites(att, first, second)
        if sites:
            blocks[i] = replace(blocks[i], attention=replace(att, shape_sites=sites))
    return replace(plan, block_plans=tuple(blocks))


def _eligible(att: AttentionPlan) -> bool:
    """A head count and width to look for, and no head width equal to a head count (a size
    argument holding it could then be either)."""
    if not (att.num_heads and att.head_dim) or att.packed:
        return False
    return att.head_dim not in {att.num_heads, att.num_kv_heads or att.num_heads}


def _sites(att: AttentionPlan, first: dict, second: dict) -> tuple[ShapeSite, ...]:
    kv = att.num_kv_heads or att.num_heads
    full = {att.num_heads, kv, att.num_heads * att.head_dim, kv * att.head_dim}
    sites = []
    for key, (op, sizes, pieces) in first.items():
        other = second.get(key)
        if other is None or other[0] != op or len(other[1]) != len(sizes) or other[2] != pieces:
            continue
        constants = tuple(a if a == b else None for a, b in zip(sizes, other[1]))
        divided = tuple(c is not None and c in full for c in constants)
        if any(divided):
            sites.append(ShapeSite(key, op, constants, divided, pieces))
    return tuple(sites)


@contextmanager
def _recording(root: nn.Module, plan: ModelPlan, targets: dict[int, AttentionPlan], records: dict) -> Iterator[None]:
    """Each target attention's first forward runs under a :class:`_Record` (entered and left
    around the forward itself, so an exception cannot leave the mode active)."""
    undo = []
    for i, att in targets.items():
        module = root.get_submodule(paths.join(plan.block_path(i), att.path))
        original = module.forward

        def forward(*args: Any, _i: int = i, _original: Callable = original, **kwargs: Any) -> Any:
            if _i in records:
                return _original(*args, **kwargs)
            mode = _Record()
            with mode:
                out = _original(*args, **kwargs)
            records[_i] = mode.calls
            return out

        undo.append(replace_forward(module, forward))
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()
