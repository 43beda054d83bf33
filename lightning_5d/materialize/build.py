"""``MetaBuild``: the strategy's one handle on a meta-device build (record -> capture -> materialize)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_5d.materialize.draws import CHUNK_BYTES
from lightning_5d.materialize.apply import capture, has_meta, materialize, to_device_except_meta
from lightning_5d.materialize.record import InitLog, Ref, recording
from lightning_5d.materialize.stand_in import RecordedValues, recorded_values


class MetaBuild:
    def __init__(self, log: InitLog, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.log = log
        # Tensors above this are recomputed in row chunks of this size (materialize/chunks.py).
        self.chunk_bytes = chunk_bytes
        self.refs: dict[str, Ref] | None = None  # set by capture() when the model has meta tensors
        self.filled = 0  # names materialized on this rank
        self.chunked = 0  # of those, recomputed in row chunks

    @property
    def active(self) -> bool:
        """Whether the model being set up waits for materialization."""
        return self.refs is not None

    @contextmanager
    def recording(self) -> Iterator[None]:
        with recording(self.log):
            yield

    def capture(self, module: nn.Module) -> None:
        if has_meta(module):
            self.refs = capture(module, self.log)

    def build_now(self, module: nn.Module, context: Callable[..., Any]) -> None:
        """Call ``configure_model`` under ``context(empty_init=True)`` if the module has no parameters yet.

        Lightning requires the hook to be idempotent (it is called once per fit/validate/...),
        so its own call after this one finds the model built.
        """
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if next(module.parameters(), None) is not None or not is_overridden("configure_model", module):
            return
        with context(empty_init=True):
            module.configure_model()

    def values(self, module: nn.Module) -> RecordedValues:
        """A mode in which ``module``'s meta tensors compute with their recorded values (discovery's
        probe forwards: :mod:`.stand_in`); only before :meth:`materialize`."""
        assert self.refs is not None
        return recorded_values(module, self.log)

    def to_device(self, module: nn.Module, device: torch.device) -> None:
        to_device_except_meta(module, device)

    def materialize(
        self,
        module: nn.Module,
        device: torch.device,
        dims: Sequence[Any],
    ) -> None:
        """``dims``: the strategy's tp / ep / pp objects (None where a dimension is off)."""
        assert self.refs is not None
        for dim in dims:  # tp / ep / pp took their device from the (meta) parameters they were given
            if dim is not None and getattr(dim, "device", None) is not None and dim.device.type == "meta":
                dim.device = device
        self.filled, self.chunked = materialize(module, self.log, self.refs, device, [d for d in dims if d is not None],
                                  chunk_bytes=self.chunk_bytes)  # fmt: skip
        self.refs = None  # done: a later fit/validate on this Trainer keeps the trained weights
        self.log = InitLog()  # the recording's storages and draw states are no longer needed
