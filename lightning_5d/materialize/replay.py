"""Recompute one recorded tensor at its full shape, on CPU, with the values of an eager build.

``value(ref)`` finds the last call that created or fully overwrote the ref's storage, runs
it for real, then the later in-place calls on that storage, in recorded order. Inputs from
other storages (a rotary table's ``arange``, a ``copy_`` source) are recomputed the same way
at the point they were read. Each random call first restores the generator state recorded
for it, so the order tensors are recomputed in does not matter: a rank may recompute only
the tensors it holds, one at a time, and still get a single process's numbers.

Memory: the tensor being recomputed plus the inputs of its calls (for parameters: one
tensor; earlier random fills that a later one overwrites are never run).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_5d.materialize.record import EMPTY_CREATIONS, InitLog, Op, Ref
from lightning_5d.materialize.trees import leaves, map_leaves


class Uninitialized(Exception):
    """A storage whose recorded history never gives it defined contents (torch.empty, or unrecorded)."""

    def __init__(self, key: int, why: str) -> None:
        super().__init__(why)
        self.key = key


class Replay:
    def __init__(self, log: InitLog, device: torch.device | str = "cpu") -> None:
        self.log = log
        self.device = torch.device(device)

    def value(self, ref: Ref) -> Tensor:
        """The tensor at the end of the recording (a view on a fresh storage of its own)."""
        storage = self._storage(ref.key, len(self.log.ops), {})
        return _view(storage, ref, self.device)

    def defined(self, key: int) -> str | None:
        """None if the storage ends with defined contents, else why not (cheap: no tensor is built)."""
        history = self.log.history.get(key, [])
        start = self._start(key, history)
        if start is None:
            return "no recorded call creates it" if not history else "it is only changed in part, never filled"
        op = self.log.ops[start]
        if op.name in EMPTY_CREATIONS and key in op.creates and start == history[-1]:
            return f"it is created by torch.{op.name} and never written"
        return None

    def start(self, key: int) -> int | None:
        """The index of the call the storage's final contents start from (its creation or last full overwrite)."""
        return self._start(key, self.log.history.get(key, []))

    def _start(self, key: int, history: list[int]) -> int | None:
        for i in reversed(history):
            op = self.log.ops[i]
            if key in op.creates or key in op.overwrites:
                return i
        return None

    def _storage(self, key: int, upto: int, memo: dict) -> torch.UntypedStorage:
        """Storage ``key`` as it was just before call ``upto``."""
        if (key, upto) in memo:
            return memo[(key, upto)]
        history = [i for i in self.log.history.get(key, []) if i < upto]
        start = self._start(key, history)
        why = self.defined(key) if start is None else None
        if start is None:
            raise Uninitialized(key, why or "it has no defined contents")
        op = self.log.ops[start]
        if key in op.creates and op.name in EMPTY_CREATIONS:
            # Later calls write it (a table filled piece by piece); zeros make any gap deterministic.
            storage = torch.zeros(self.log.nbytes[key], dtype=torch.uint8, device=self.device).untyped_storage()
        elif key in op.creates:
            storage = self._created(op, key, memo)
        else:
            storage = torch.UntypedStorage(self.log.nbytes[key], device=self.device)
            self._run(op, key, storage, memo)
        for i in history:
            if i > start:
                self._run(self.log.ops[i], key, storage, memo)
        memo[(key, upto)] = storage
        return storage

    def _created(self, op: Op, key: int, memo: dict) -> torch.UntypedStorage:
        out = self._run(op, None, None, memo)
        flat = leaves(out)
        for ref, real in zip(op.outs, flat):
            if ref is not None and ref.key == key:
                # A fresh storage of exactly the recorded size (the result may share a bigger one).
                storage = torch.UntypedStorage(self.log.nbytes[key], device=self.device)
                _view(storage, ref, self.device).copy_(real)
                return storage
        raise AssertionError(f"call {op.index} ({op.name}) recorded as creating storage {key} does not return it")

    def _run(self, op: Op, key: int | None, storage: torch.UntypedStorage | None, memo: dict) -> Any:
        def real(x: Any) -> Any:
            if not isinstance(x, Ref):
                return x
            if x.key == key:
                return _view(storage, x, self.device)
            return _view(self._storage(x.key, op.index, memo), x, self.device)

        args, kwargs = map_leaves(real, op.args), map_leaves(real, op.kwargs)
        if op.factory:
            kwargs["device"] = self.device
        if op.generators:
            kwargs = {k: _restored(v, op.generators) for k, v in kwargs.items()}
            args = tuple(_restored(a, op.generators) for a in args)
        with torch.no_grad():
            if op.rng is not None:
                torch.set_rng_state(op.rng)
            return op.func(*args, **kwargs)


def _restored(x: Any, states: dict[int, Tensor]) -> Any:
    if isinstance(x, torch.Generator) and id(x) in states:
        g = torch.Generator(device=x.device)
        g.set_state(states[id(x)])
        return g
    return x


def _view(storage: torch.UntypedStorage, ref: Ref, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)
