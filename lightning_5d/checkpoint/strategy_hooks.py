"""Lightning's checkpoint, pretrained-weights and data-position hooks of ``FiveDStrategy``, routed to
:class:`~lightning_5d.checkpoint.strategy_io.StrategyCheckpoints` (which knows how each
dimension splits the state) and :class:`~lightning_5d.checkpoint.data_position.ResumableLoader`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Mapping

from lightning.fabric.utilities.types import _Stateful
from typing_extensions import override

from lightning_5d.applied import AppliedDimensions
from lightning_5d.checkpoint.data_position import ResumableLoader
from lightning_5d.checkpoint.pretrained import PretrainedLoad, load_pretrained
from lightning_5d.checkpoint.strategy_io import StrategyCheckpoints
from lightning_5d.config import StrategyOptions


class CheckpointHooks:
    """Mixed into ``FiveDStrategy`` ahead of Lightning's ``ParallelStrategy``."""

    _checkpoints: StrategyCheckpoints
    _applied: AppliedDimensions

    def _take_checkpoint_options(self, options: StrategyOptions) -> None:
        self._checkpoints = StrategyCheckpoints(
            self, options.checkpoint_format, options.checkpoint_write, options.keep_last_k
        )
        # Weights to start from (a plain or Hugging Face state dict), read once after parallelizing.
        self._pretrained = (options.pretrained, options.pretrained_prefix) if options.pretrained is not None else None
        self.pretrained_load: PretrainedLoad | None = None  # what was loaded: names, prefix, groups

    def _load_pretrained(self) -> None:
        """Each rank reads only its own pieces; a ckpt_path given to fit is restored after setup
        and so still wins over these weights."""
        if self._pretrained is None:
            return
        path, prefix = self._pretrained
        self.pretrained_load = load_pretrained(self, path, prefix=prefix)
        self._pretrained = None  # a later fit/validate on this Trainer keeps the trained weights

    @property
    def checkpoints(self) -> StrategyCheckpoints:
        return self._checkpoints

    # The applied dimensions under the names checkpoint/strategy_io.py reads.
    _tp = property(lambda self: self._applied.tp)
    _ep = property(lambda self: self._applied.ep)
    _pp = property(lambda self: self._applied.pp)
    _zero = property(lambda self: self._applied.zero)
    _fsdp_units = property(lambda self: self._applied.fsdp_units)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # optimizer states only exist in their sharded form after setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True  # through load_optimizer_state_dict below, after setup sharded them

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
