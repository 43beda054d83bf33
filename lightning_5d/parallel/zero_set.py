"""Several ZeRO engines driven as one: dense parameters and expert parameters reduce
over different groups, but the strategy starts, pauses and syncs them together."""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_5d.parallel.data import ZeroDataParallel


class ZeroSet:
    def __init__(self, engines: Sequence[ZeroDataParallel]) -> None:
        self.engines = list(engines)

    def _set_all(self, name: str, value: bool) -> None:
        for e in self.engines:
            setattr(e, name, value)

    active = property(lambda self: self.engines[0].active, lambda self, v: self._set_all("active", v))
    paused = property(lambda self: self.engines[0].paused, lambda self, v: self._set_all("paused", v))
    require_sync = property(lambda self: self.engines[0].require_sync, lambda self, v: self._set_all("require_sync", v))

    @property
    def stage(self):
        return self.engines[0].stage

    def start_backward(self) -> None:
        for e in self.engines:
            e.start_backward()

    def finish_gradient_sync(self) -> None:
        for e in self.engines:
            e.finish_gradient_sync()

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and not any(e.holds(p) for e in self.engines):
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of "
                        f"the LightningModule; ZeRO can only shard the module's own parameters."
                    )
        for e in self.engines:
            e.shard_optimizer(optimizer)

    def refresh_masters(self) -> None:
        for e in self.engines:
            e.refresh_masters()

    def master_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for e in self.engines:
            names.update(e.master_names())
        return names

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self._single("save").full_optimizer_state(optimizer)

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self._single("load").load_full_optimizer_state(optimizer, state)

    def _single(self, verb: str) -> ZeroDataParallel:
        if len(self.engines) > 1:
            from lightning_5d.checkpoint import CheckpointError

            raise CheckpointError(
                f"cannot {verb} optimizer state under ep > 1 yet (expert and dense slices live on different "
                f"groups); save weights only (ModelCheckpoint(save_weights_only=True)) or train with ep=1."
            )
        return self.engines[0]
