"""The 5D strategy's checkpoints, as Lightning's hooks see them: one object that writes and reads.

Writing (what each rank contributes, the save in either format, removals):
:class:`~lightning_5d.checkpoint.strategy_writer.CheckpointWriter`. Reading (the checkpoint
dict, the model's and optimizers' state into any layout, the random generators):
:class:`~lightning_5d.checkpoint.strategy_reader.CheckpointReader`. The two meet in one
place, the run's lineage: a load makes the writer's later saves the loaded run's next start.
The options themselves: :mod:`lightning_5d.checkpoint.options`.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_5d.checkpoint.lineage import Branch
from lightning_5d.checkpoint.options import CheckpointFormat, CheckpointWrite, checked_options
from lightning_5d.checkpoint.strategy_reader import CheckpointReader, StoredState
from lightning_5d.checkpoint.strategy_state import split_dims
from lightning_5d.checkpoint.strategy_writer import CheckpointWriter

__all__ = ["CheckpointFormat", "CheckpointWrite", "StoredState", "StrategyCheckpoints", "checked_options"]


class StrategyCheckpoints:
    def __init__(
        self,
        strategy: Any,
        format: CheckpointFormat = CheckpointFormat.SHARDED,
        write: CheckpointWrite = CheckpointWrite.SYNC,
        keep_last_k: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.writer = CheckpointWriter(strategy, *checked_options(format, write, keep_last_k))
        self.reader = CheckpointReader(strategy, on_resume=self.writer.continue_from)

    # ------------------------------------------------------------------ options and lineage
    format = property(lambda self: self.writer.format)
    write = property(lambda self: self.writer.write)
    keep_last_k = property(lambda self: self.writer.keep_last_k)

    @property
    def branch(self) -> Branch:
        return self.writer.branch

    @property
    def splits(self) -> list:
        """tp, ep and pp as they split this model (each has full_state / local_state)."""
        return split_dims(self.strategy)

    # ------------------------------------------------------------------ write
    def full_model_state(self) -> dict[str, Any]:
        """Every tensor at its full shape, on every rank (collective over all dims)."""
        return self.writer.full_model_state()

    def model_state(self) -> dict[str, Any]:
        return self.writer.model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.writer.optimizer_state(optimizer)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.writer.save(checkpoint, filepath, storage_options)

    def wait(self) -> None:
        """Block until an asynchronous save is on disk and published (or failed)."""
        self.writer.wait()

    def remove(self, filepath: Any) -> None:
        self.writer.remove(filepath)

    # ------------------------------------------------------------------ read
    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        return self.reader.load(path, weights_only)

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.reader.load_model(checkpoint, strict)

    def after_model_load(self) -> None:
        self.reader.after_model_load()

    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        self.reader.load_optimizers(checkpoint)

    def restore_rng(self) -> None:
        self.reader.restore_rng()
