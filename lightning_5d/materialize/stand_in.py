"""Run a meta-built model with the values an eager build gives, recomputed as each call reads them.

Discovery learns what names and shapes cannot say by running the model on probe token ids
(:mod:`lightning_5d.plan.observe`): which output columns of a fused projection feed q, k and
v (GPT-NeoX interleaves them per head), where a forward without ``position_ids`` reads token
positions, the sizes it passes to ``view`` / ``split``, which phase of the forward reads a
parameter outside the blocks, which linears feed the attention call. A model built on the
meta device has nothing to run on; discovery then assumed, and on tests/zoo 12 of 60 cells
built on meta were refused where the eager build trains, and GPT-NeoX's fused
``query_key_value`` was cut as ``[q | k | v]`` (wrong numbers that only the plan verifier
stopped).

Inside :class:`RecordedValues` every torch call that is handed one of the recording's meta
tensors (a parameter, a buffer, a view of one) is handed instead its value, recomputed from
the build's recording (:class:`.replay.Replay`: a single process's numbers, the same an eager
build holds), on CPU; a ``meta`` device asked for (``torch.arange(n, device=w.device)``,
``x.to(w.device)``) is CPU, and a recorded tensor reports CPU as its device. Questions about
shape and type are answered by the meta tensor itself, without recomputing anything.
Identity is kept where discovery checks it: its own modes and hooks, entered inside this one,
see the model's meta parameters before they are swapped.

Memory: values are kept for reuse while they fit in ``budget`` bytes (by default the larger
of the largest tensor and the model's bytes over the world size, i.e. about the share the
rank is about to hold); past it each read recomputes its tensor and drops it after the call:
without gradients the peak stays at the budget plus one tensor. A probe that runs with
gradients (the fused-layout and attention-tracing probes) keeps what its graph saves, the
weights included, until its backward: up to the whole model on the rank, for the models that
need those probes (fused q/k/v or [gate|up] projections, attention projections names do not
give). Time: one recomputation of every tensor read, per probe forward, for tensors past the
budget.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.materialize.record import InitLog, Ref
from lightning_5d.materialize.replay import Replay, Uninitialized
from lightning_5d.materialize.trees import leaves, map_leaves

_CPU = torch.device("cpu")

# Calls about a tensor's shape and type: the meta tensor answers them (no recomputation). A property
# reaches the mode as its getter's ``__get__``, a new method-wrapper at each access: compared by equality.
_SHAPE_ONLY = frozenset(
    {getattr(Tensor, name).__get__ for name in ("shape", "dtype", "ndim", "layout", "requires_grad", "is_leaf",
                                                "grad_fn", "is_sparse", "is_quantized", "is_mkldnn")}
    | {getattr(Tensor, name) for name in ("size", "dim", "numel", "nelement", "stride", "element_size",
                                          "is_floating_point", "is_complex", "is_contiguous", "storage_offset",
                                          "__len__", "ndimension", "is_signed")}
)  # fmt: skip
# Where a recorded tensor lives, as an eager build on CPU answers.
_WHERE = {Tensor.device.__get__: _CPU, Tensor.is_meta.__get__: False, Tensor.is_cpu.__get__: True,
          Tensor.is_cuda.__get__: False}  # fmt: skip


class UnrecordedMetaTensor(RuntimeError):
    """A call mixed a meta tensor with no recorded value into real ones."""


class RecordedValues(TorchFunctionMode):
    """While active, the recording's meta tensors compute with their recorded values (on CPU)."""

    def __init__(self, log: InitLog, budget: int) -> None:
        super().__init__()
        self.log = log
        self.replay = Replay(log)
        self.budget = budget
        self.kept: dict[Ref, Tensor] = {}
        self.kept_bytes = 0
        self.recomputed = 0  # tensors recomputed (a kept one counts once): the mode's cost

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:
            return func(*args, **kwargs)
        if func in _WHERE:
            recorded = bool(args) and isinstance(args[0], Tensor) and self._ref(args[0]) is not None
            if recorded:
                return _WHERE[func]
            return func(*args, **kwargs)
        originals = {}  # id(value) -> the meta tensor it stands for, in this call
        args, kwargs = map_leaves(lambda x: self._swap(x, originals), (args, kwargs))
        tensors = [x for x in leaves((args, kwargs)) if isinstance(x, Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            # torch lets some CPU kernels read a meta tensor (torch.mm gives numbers from nowhere):
            # a tensor with no recorded value must stop the probe, as it did before this mode.
            raise UnrecordedMetaTensor(f"{getattr(func, '__name__', func)} read a meta tensor the build did not record")
        out = func(*args, **kwargs)
        # A call that returns its input (``w.to(x.device)``, ``type_as`` of the same dtype, an in-place
        # op) gives back the model's own tensor, as in an eager build: discovery's position reads
        # tell a table read whole from another use by that identity.
        return originals.get(id(out), out) if isinstance(out, Tensor) else out

    def _swap(self, x: Any, originals: dict[int, Tensor]) -> Any:
        value = self._real(x)
        if value is not x and isinstance(value, Tensor):
            originals[id(value)] = x
        return value

    def _ref(self, t: Tensor) -> Ref | None:
        return self.log.ref(t) if t.is_meta else None

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.device):
            return _CPU if x.type == "meta" else x
        if isinstance(x, str) and x == "meta":
            return "cpu"
        if not isinstance(x, Tensor) or not x.is_meta:
            return x
        ref = self.log.ref(x)
        if ref is None:
            return x  # not the recording's: refused in __torch_function__ if the call also has real tensors
        value = self.kept.get(ref)
        if value is None:
            try:
                # The replay sets the CPU generator before each draw; the user's stream stays as it was.
                with torch.random.fork_rng(devices=[]):
                    value = self.replay.value(ref)
            except Uninitialized:
                return x
            self.recomputed += 1
            nbytes = value.untyped_storage().nbytes()
            if self.kept_bytes + nbytes <= self.budget:
                self.kept[ref] = value
                self.kept_bytes += nbytes
        if x.requires_grad and not value.requires_grad and torch.is_grad_enabled():
            # A parameter stays a leaf that wants a gradient (a forward may test it: PyTorch's
            # fused encoder path); its gradient, if any, is thrown away with the value.
            value = value.detach().requires_grad_(True)
        return value


def recorded_values(module: nn.Module, log: InitLog, budget: int | None = None) -> RecordedValues:
    """The mode for ``module`` built under ``log``'s recording; ``budget`` None: the larger of its
    largest tensor and its bytes over the world size."""
    if budget is None:
        sizes = [t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if t.is_meta]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        budget = max(max(sizes, default=0), math.ceil(sum(sizes) / world))
    return RecordedValues(log, budget)
