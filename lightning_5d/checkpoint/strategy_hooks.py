"""Lightning's checkpoint and data-position hooks of ``FiveDStrategy``, routed to
:class:`~lightning_5d.checkpoint.strategy_io.StrategyCheckpoints` (which knows how each
dimension splits the state) and :class:`~lightning_5d.checkpoint.data_position.ResumableLoader`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Mapping

from lightning.fabric.utilities.types import _Stateful
from typing_extensions import override

from lightning_5d.checkpoint.data_position import ResumableLoader
from lightning_5d.checkpoint.strategy_io import StrategyCheckpoints


class CheckpointHooks:
    """Mixed into ``FiveDStrategy`` ahead of Lightning's ``ParallelStrategy``."""

    _checkpoints: StrategyCheckpoints

    @property
    def checkpoints(self) -> StrategyCheckpoints:
        return self._checkpoints

    def full_model_state(self) -> dict[str, Any]:
        """Every tensor at its full shape, on every rank, whatever the layout (a collective)."""
        return self._checkpoints.full_model_state()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.model_state()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath) -> None:
        self._checkpoints.remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizers(checkpoint)

    @override
    def on_train_start(self) -> None:
        self._checkpoints.restore_rng()  # a resumed run's generators, now that the data is set up

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, _Stateful):
            return dataloader  # a loader that keeps its own position (StatefulDataLoader) needs no help
        return ResumableLoader(dataloader, trainer)

    def _keyed_by_model_params(self, optimizer):
        """fp32 masters stand in for bf16 parameters in the optimizer; checkpoints name the parameters."""
        precision = self._five_d_precision
        masters = precision.masters_of(optimizer) if precision is not None else None
        return masters.as_model_params() if masters is not None else nullcontext()
