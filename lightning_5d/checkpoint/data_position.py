"""The training data's position as part of a checkpoint, so a mid-epoch resume sees the
batches the interrupted run had not seen yet, in the same order.

Lightning saves the state of a train dataloader that has ``state_dict``/``load_state_dict``
and hands it back on restart; a plain ``DataLoader`` has neither, and Lightning then
restarts the epoch from its first batch. The strategy wraps the train dataloader in
``ResumableLoader``: its state is how many batches of which epoch the loop has processed,
and on a resume in that same epoch it draws and drops that many batches first. The
sampler's permutation depends only on the seed and the epoch, so the batches that follow
are the ones the interrupted run would have trained on.
"""

from __future__ import annotations

from typing import Any, Iterator

from lightning.fabric.utilities.data import _set_sampler_epoch


class ResumableLoader:
    _OWN = ("loader", "_trainer", "_resume")

    def __init__(self, loader: Any, trainer: Any) -> None:
        self.loader = loader
        self._trainer = trainer
        self._resume: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        # A checkpoint from an epoch's last batch resumes with the next epoch, which Lightning
        # starts by itself: skipping would only exhaust the finished one.
        skip = resume is not None and not resume["finished"] and resume["epoch"] == self._trainer.current_epoch
        if skip:
            # Lightning asks for this iterator before it seeds the epoch's sampler; the batches
            # drawn below must already come from the resumed epoch's order.
            _set_sampler_epoch(self.loader, resume["epoch"])
        iterator = iter(self.loader)
        if skip:
            # Drawing rather than slicing the sampler keeps any user sampler/collate logic intact;
            # it costs the time to load the skipped batches once.
            for _ in range(resume["batches"]):
                next(iterator, None)
        return iterator

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_sampler, dataset ...: Lightning reads them (set_epoch, lengths) from the loader
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # What Lightning sets (worker_init_fn when seeding workers) belongs to the loader.
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def state_dict(self) -> dict[str, int]:
        progress = self._trainer.fit_loop.epoch_loop.batch_progress
        return {
            "epoch": int(self._trainer.current_epoch),
            "batches": int(progress.current.processed),
            "finished": int(progress.is_last_batch),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = {k: int(state[k]) for k in ("epoch", "batches", "finished")}
