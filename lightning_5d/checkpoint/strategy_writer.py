"""The writing half of the 5D strategy's checkpoints: what each rank contributes, and saving it.

Both formats name every tensor by the unsplit model: each rank first undoes the splits a
name cannot express (tensor-parallel shards, grouped experts' slices) and keeps the ones a
name does express (a pipeline stage's layers, ``experts.<global index>``, FSDP2 shards as
DTensors with their offsets). The full format then gathers everything to rank 0; the
sharded format lets torch.distributed.checkpoint write each rank's pieces (keys several
ranks hold are written once), synchronously or in a background thread, then publishes the
directory. Every checkpoint carries the run's lineage stamp (``lineage.py``); the writer
owns this start's branch, which a load turns into the loaded run's next start.
Reading back: :mod:`lightning_5d.checkpoint.strategy_reader`.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException

from lightning_5d.checkpoint import files, full, optimizer_groups, sharded
from lightning_5d.checkpoint.errors import CheckpointError, failure, first_problem, raise_if_any
from lightning_5d.checkpoint.export import hf_info
from lightning_5d.checkpoint.lineage import STAMP_KEY, Branch
from lightning_5d.checkpoint.options import CheckpointFormat, CheckpointWrite
from lightning_5d.checkpoint.strategy_state import full_tensors, per_stat, split_dims

log = logging.getLogger(__name__)


class _Pending:
    """An asynchronous save in flight: its future, whether publishing finished, and how it failed."""

    def __init__(self, future: Future) -> None:
        self.future, self.done, self.error = future, threading.Event(), None


class CheckpointWriter:
    """What each rank puts into a checkpoint (``model_state``, ``optimizer_state``) and the save
    of it in the configured format; removals of older checkpoints (``remove``, ``keep_last_k``)."""

    def __init__(
        self, strategy: Any, format: CheckpointFormat, write: CheckpointWrite, keep_last_k: int | None
    ) -> None:
        self.strategy = strategy
        self.format, self.write, self.keep_last_k = format, write, keep_last_k
        self._pending: _Pending | None = None
        self._deferred_removals: list[Any] = []
        self._async_group: Any = None
        # This start of the run (lineage.py): a fresh run until a checkpoint is loaded. Only
        # rank 0's is written anywhere (the record, the stamp in a checkpoint), so the ranks'
        # differing random ids never meet.
        self._branch: Branch | None = None

    @property
    def branch(self) -> Branch:
        if self._branch is None:
            self._branch = Branch.fresh(job=_job_id())
        return self._branch

    def continue_from(self, stamp: Any) -> Branch:
        """Saves after a load continue the run that wrote it (``stamp``, its lineage), as its next start."""
        self._branch = Branch.resumed_from(stamp, job=_job_id())
        return self._branch

    # ------------------------------------------------------------------ what each rank holds
    @property
    def splits(self) -> list:
        return split_dims(self.strategy)

    def full_model_state(self) -> dict[str, Any]:
        """Every tensor at its full shape, on every rank (collective over all dims)."""
        s = self.strategy
        splits = self.splits
        state = full.full_model_state(s.lightning_module, sharded=bool(s._fsdp_units), every_rank=bool(splits))
        for split in splits:  # tp shards, then ep's experts, then the other pipeline stages
            state = split.full_state(state)
        return state

    def model_state(self) -> dict[str, Any]:
        if self.format == CheckpointFormat.FULL:
            return self.full_model_state()
        return self._owned_model_state()

    def _owned_model_state(self) -> dict[str, Any]:
        """This rank's pieces under unsplit names (collective over tp and ep, not pp)."""
        s = self.strategy
        if not s._fsdp_units:
            state = dict(s.lightning_module.state_dict())
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(s.lightning_module)  # FSDP2 shards stay DTensors
        if s._tp is not None or s._ep is not None:
            # tp and grouped-expert gathers work on plain tensors; FSDP's shards are gathered over dp first
            state = full_tensors(state)
            if s._tp is not None:
                state = s._tp.full_state(state)
            if s._ep is not None:
                state = s._ep.full_state(state, gather_listed=False)
        return state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        s = self.strategy
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self.format == CheckpointFormat.FULL:
            for dim, split in (("pp", s._pp is not None), ("ep", s._ep is not None and s._ep.ep > 1)):
                if split:
                    raise CheckpointError(
                        f"the full checkpoint format cannot hold optimizer state under {dim} > 1 (each {dim} rank "
                        f"holds its own part); use FiveDStrategy(checkpoint_format='sharded'), the default, or save "
                        f"weights only."
                    )
        with s._keyed_by_model_params(optimizer):
            if s._zero is not None:
                state = s._zero.full_optimizer_state(optimizer)
            elif self.format == CheckpointFormat.SHARDED:  # FSDP2's shards stay DTensors unless a split needs them
                state = full.sharded_optimizer_state(s.lightning_module, optimizer)
                if s._tp is not None or s._ep is not None:
                    state = {**state, "state": per_stat(state["state"], full_tensors, all_stats=True)}
            else:  # FSDP2, or no data-parallel peers: torch's own full format
                state = full.dcp_optimizer_state(s.lightning_module, optimizer, every_rank=bool(self.splits))
        if s._tp is not None:
            state = s._tp.full_optimizer_state(state)
        if s._ep is not None and s._ep.ep > 1:
            gather = functools.partial(s._ep.full_state, gather_listed=self.format == CheckpointFormat.FULL)
            state = {**state, "state": per_stat(state["state"], gather)}
        return state

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # The stamp lets a resume continue this run's lineage (the same run id, the next start).
        checkpoint[STAMP_KEY] = self.branch.stamp(_step(checkpoint, filepath))
        if self.format == CheckpointFormat.FULL:
            self._save_full(checkpoint, filepath, storage_options)
        else:
            if storage_options is not None:
                raise TypeError("storage_options are not supported by the sharded checkpoint format.")
            self._save_sharded(checkpoint, Path(filepath))

    def _save_full(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        # Every rank gathered full tensors in dump_checkpoint; rank 0 writes, and everyone
        # learns whether that worked, so a failed write cannot leave the others hanging.
        s = self.strategy
        checkpoint["layout"] = self._layout_record([k for k in ("state_dict", "optimizer_states") if k in checkpoint])
        error = None
        if s.is_global_zero:
            try:
                notes = full.atomic_save(
                    checkpoint, filepath, s.checkpoint_io, storage_options, self.branch, _step(checkpoint, filepath)
                )
                _log_notes(notes)
                self._prune(Path(filepath))
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        raise_if_any(error, f"rank 0 could not write checkpoint {filepath}")

    def _save_sharded(self, checkpoint: dict[str, Any], final: Path) -> None:
        s = self.strategy
        self.wait()  # the previous asynchronous save is published before this one starts
        partial = files.partial_path(final)
        error = None
        if s.is_global_zero:
            try:
                files.remove_stale_partials(final.parent)  # saves that were killed: never published
                partial.mkdir(parents=True)
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        raise_if_any(error, f"could not create {partial}")
        try:  # a rank that fails here must not leave the others waiting in the collectives below
            tensors = _tensors_of(checkpoint)
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            states = checkpoint.get("optimizer_states", [])
            mine = (optimizer_groups.local_groups(states), _nontensor_stats(states))
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        raise_if_any(error, f"preparing checkpoint {final} failed")
        # Each pp stage (ep rank) holds its own parameters' groups and states: recorded from every rank.
        everyone = _from_every_rank(mine)
        records = optimizer_groups.merge_groups([groups for groups, _ in everyone])
        meta["optimizer_param_groups"] = [options for options, _ in records]
        meta["optimizer_param_group_of"] = [group_of for _, group_of in records]
        meta["optimizer_nontensor_state"] = optimizer_groups.merge_nontensor([stats for _, stats in everyone])
        meta["rng_states"] = _from_every_rank(_rng_state())
        layout = self._layout_record(contains=[k for k in ("state_dict", "optimizer_states") if k in checkpoint])

        # Serialized now: callbacks hand over live objects that change before a background write.
        meta_bytes = sharded.serialize(meta)

        step, branch = _step(checkpoint, final), self.branch

        def publish() -> None:
            sharded.write_extras(partial, meta_bytes, layout, step)
            files.publish(partial, final)
            _log_notes(files.update_latest(final, branch, step))
            self._prune(final)

        if self.write == CheckpointWrite.ASYNC:
            if self._async_group is None:  # background writes must not share a group with training
                self._async_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            future = sharded.write_tensors(tensors, partial, group=self._async_group, asynchronous=True)
            pending = _Pending(future)
            rank0 = s.is_global_zero

            def finish(f: Future) -> None:
                try:
                    f.result()
                    if rank0:
                        publish()
                except BaseException as err:  # the previous `latest` stays; wait() reports it on every rank
                    pending.error = f"{type(err).__name__}: {err}"
                    log.error(
                        "asynchronous checkpoint %s failed (%s); `latest` still names the previous one", final, err
                    )
                finally:
                    pending.done.set()

            future.add_done_callback(finish)
            self._pending = pending
            return
        error = None
        try:
            sharded.write_tensors(tensors, partial)
        except (Exception, CheckpointException) as err:
            error = f"{type(err).__name__}: {err}"
        raise_if_any(error, f"writing {final} failed")
        if s.is_global_zero:
            try:
                publish()
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        raise_if_any(error, f"rank 0 could not finish checkpoint {final}")

    def wait(self) -> None:
        """Block until an asynchronous save is on disk and published (or failed); then carry out
        the removals asked for meanwhile, which had to wait for the new checkpoint."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.done.wait()
        error = first_problem(pending.error)
        removals, self._deferred_removals = self._deferred_removals, []
        if error is not None:
            raise failure("the asynchronous checkpoint save failed", error)
        for path in removals:
            self.remove(path)

    def _prune(self, final: Path) -> None:
        if self.keep_last_k is not None:
            files.prune(final.parent, self.keep_last_k, branch=self.branch)

    def remove(self, filepath: Any) -> None:
        """ModelCheckpoint dropping an older checkpoint. While a newer one is still being written
        that older one may be the only complete checkpoint: it goes once the newer is published.
        The one `latest` names is never removed."""
        if self._pending is not None:
            self._deferred_removals.append(filepath)
            return
        if self.strategy.is_global_zero and files.is_local(filepath):
            path = Path(filepath)
            if path.is_symlink() or files.latest_checkpoint(path.parent, quiet=True) != path:
                files.remove(path)

    def _layout_record(self, contains: list[str]) -> dict[str, Any]:
        s = self.strategy
        return {
            "layout": {**s.layout.sizes(), "ep": s.layout.ep},
            "zero": int(s.zero_stage),
            "sequence_parallel": bool(s.config.sequence_parallel),
            "world_size": s.world_size,
            "contains": contains,
            "hf": hf_info(s.lightning_module),
        }



def _from_every_rank(mine: Any) -> list[Any]:
    """``mine`` of every rank, in rank order (a collective)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _step(checkpoint: Mapping[str, Any], filepath: Any) -> int:
    step = checkpoint.get("global_step")
    return int(step) if isinstance(step, int) else files._step_of(Path(str(filepath)))


def _log_notes(notes: list[str]) -> None:
    for note in notes:
        log.warning("[lightning_5d] %s", note)


def _tensors_of(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    tensors = {sharded.MODEL + k: v for k, v in checkpoint["state_dict"].items() if isinstance(v, Tensor)}
    for i, state in enumerate(checkpoint.get("optimizer_states", [])):
        for name, stats in state["state"].items():
            for stat, value in stats.items():
                if isinstance(value, Tensor):
                    tensors[f"{sharded.OPTIM}{i}.state.{name}.{stat}"] = value
    return tensors


def _nontensor_stats(states: list[Mapping[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    # Plain numbers some optimizers keep per parameter (a step count as an int, a None buffer).
    return [
        {n: {k: v for k, v in st.items() if not isinstance(v, Tensor)} for n, st in s["state"].items()} for s in states
    ]


def _rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [int(random.getstate()[0]), list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state
