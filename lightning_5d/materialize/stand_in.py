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

Memory: values are kept for reuse while they fit in ``budget`` bytes (by default the rank's
share, the model's bytes over the world size, less the largest tensor); past it each read
recomputes its tensor and drops it after the call, so a forward holds the budget plus the
tensors of the call in flight: about the share plus one tensor at most. A probe that runs a
backward (the fused-layout and attention-tracing probes) takes its gradients with respect to
activations only: the values need none (a value that wanted one would be held by its graph
node), and a value its graph saves for the backward is saved as its ref and recomputed when
the backward reads it, so the graph holds activations, never weights. Measured on nanoGPT
built on meta with nothing kept (4 layers, the largest tensor 1 MiB, the model 12.4 MiB;
tests/unit/materialize/test_stand_in.py): the CPU allocator's live bytes peak at 0.94 MiB
during discovery, where the graph held up to the whole model before.
Each recomputation first gives freed pages back to the OS (glibc would keep the dropped values'
blocks resident in its heap). Time: one recomputation of every tensor read past the budget,
per probe forward, and one per saved value its backward reads.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.heap import release_freed_memory
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
        self.packed = 0  # values a graph saved as their ref (recomputed by its backward)
        self.made: dict[int, tuple[Ref, weakref.ref]] = {}  # storage address -> the value living there
        self.bypass = 0  # > 0: the mode's own calls (the replay, a saved value's view) pass through
        self._hooks: list[Any] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY or self.bypass:
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

    def __enter__(self):
        # Saved for a backward, a recomputed value is held as its ref and recomputed when the backward
        # reads it: a probe with gradients holds activations, not the weights its graph passes.
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.pop().__exit__(*exc)

    def _value(self, ref: Ref) -> Tensor:
        """``ref``'s recorded value: the kept one, else recomputed (and kept while within budget)."""
        value = self.kept.get(ref)
        if value is not None:
            return value
        # The values read before and dropped go back to the OS first: glibc keeps freed blocks below
        # its mmap threshold (raised to the largest block freed, up to 32 MiB) in its heap, where
        # each recomputed weight would otherwise add resident pages (measured: 7x the largest tensor).
        release_freed_memory()
        # The replay sets the CPU generator before each draw; the user's stream stays as it was.
        with torch.random.fork_rng(devices=[]), _Bypass(self):
            value = self.replay.value(ref)
        self.recomputed += 1
        storage = value.untyped_storage()
        self.made[storage.data_ptr()] = (ref, weakref.ref(value))
        if self.kept_bytes + storage.nbytes() <= self.budget:
            self.kept[ref] = value
            self.kept_bytes += storage.nbytes()
        return value

    def _pack(self, t: Tensor) -> Any:
        """A saved tensor that is (a view of) a recomputed value: its ref and view; else the tensor,
        detached: a node's own output handed back with its ``grad_fn`` would hold that node, a
        cycle through C++ that Python's collector cannot see (the whole graph would outlive the probe)."""
        if t.is_meta or t.device.type != "cpu" or t.is_sparse or t.is_mkldnn or not t.untyped_storage().nbytes():
            return t.detach()
        made = self.made.get(t.untyped_storage().data_ptr())
        value = made[1]() if made is not None else None  # alive: that address is still its storage
        if value is None or value.dtype != t.dtype:
            return t.detach()
        self.packed += 1
        return _Saved(made[0], tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        value = self._value(saved.ref)
        with _Bypass(self):
            return value.as_strided(saved.size, saved.stride, saved.offset)

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
        try:
            value = self._value(ref)
        except Uninitialized:
            return x
        # No gradient is asked of it: the probes take theirs with respect to activations, and a value
        # that wanted one would be held by its graph node until the graph goes (a forward that asks,
        # PyTorch's fused encoder path, reads ``requires_grad`` from the meta tensor above).
        return value


class _Saved(NamedTuple):
    """A recomputed value saved for a backward: which, and the view of it that was saved."""

    ref: Ref
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Bypass:
    """The mode's own torch calls, made while it is on the stack (a backward's unpack), pass through."""

    def __init__(self, mode: RecordedValues) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        self.mode.bypass += 1

    def __exit__(self, *exc: object) -> None:
        self.mode.bypass -= 1


def recorded_values(module: nn.Module, log: InitLog, budget: int | None = None) -> RecordedValues:
    """The mode for ``module`` built under ``log``'s recording; ``budget`` None: its bytes over the
    world size (the rank's share) less its largest tensor, which a call may recompute on top."""
    if budget is None:
        sizes = [t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()) if t.is_meta]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        budget = max(0, math.ceil(sum(sizes) / world) - max(sizes, default=0))
    return RecordedValues(log, budget)
