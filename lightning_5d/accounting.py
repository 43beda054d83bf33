"""Bytes a rank really holds for model state: parameters, gradients, optimizer states.

Counted from the tensors themselves (local shards of DTensors), so the numbers can be put
next to the planner's formulas. A tensor that is a view of memory already counted (a ZeRO
shard that aliases its parameter) is not counted twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch
from torch import nn

from lightning_5d.piece_reads import unwatched


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state on one rank: measured here (ints) or predicted by the planner."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: "ModelStateBytes") -> "ModelStateBytes":
        return ModelStateBytes(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank (the local shard of a DTensor), unwrapped down to
    the plain tensor that owns the storage (a wrapper subclass has none of its own)."""
    inner = getattr(t, "_local_tensor", None)
    t = inner if inner is not None else t
    while type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        if len(names) != 1:
            break
        t = getattr(t, names[0])
    return t


class _StorageSet:
    """Byte ranges already counted, keyed by storage, so aliasing views are free."""

    def __init__(self) -> None:
        self._seen: dict[int, list[tuple[int, int]]] = {}

    def add(self, t: torch.Tensor) -> int:
        t = local_tensor(t)
        if t.numel() == 0:
            return 0
        base = t.untyped_storage().data_ptr()
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        spans = self._seen.setdefault(base, [])
        if any(s <= start and end <= e for s, e in spans):
            return 0
        spans.append((start, end))
        return end - start


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelStateBytes:
    with unwatched():  # from a callback's gradient hook: counting what each rank holds is what it asks
        return _model_state_bytes(module, optimizers)


def _model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> ModelStateBytes:
    seen = _StorageSet()
    params = sum(seen.add(p) for p in module.parameters())
    grads = sum(seen.add(p.grad) for p in module.parameters() if p.grad is not None)
    optimizer = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # unwrap LightningOptimizer
        for group in opt.param_groups:
            for p in group["params"]:
                # A separate master copy (mixed precision, ZeRO shard) is optimizer state.
                optimizer += seen.add(p)
                if p.grad is not None:
                    grads += seen.add(p.grad)
        for state in opt.state.values():
            for value in state.values():
                # Scalar entries (Adam's `step`) are bookkeeping, not per-parameter state.
                if isinstance(value, torch.Tensor) and local_tensor(value).dim() > 0:
                    optimizer += seen.add(value)
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)


class SavedActivationMeter:
    """Bytes autograd keeps for backward while the block runs (parameters excluded).

    Counts each storage once, so views and tensors saved by several ops are not double
    counted. Under activation checkpointing it sees only what the checkpoint keeps.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # linear saves weight.t(), a view
        if not (base.is_leaf and base.requires_grad):  # parameters are model state, not activations
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
        return t

    _pack.observes_only = True  # returns what it is given: other saved-tensor hooks may chain to it

    def __enter__(self) -> "SavedActivationMeter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
