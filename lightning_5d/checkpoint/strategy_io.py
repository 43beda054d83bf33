"""What the 5D strategy writes into a checkpoint and how a layout reads it back.

Both formats name every tensor by the unsplit model: each rank first undoes the splits a
name cannot express (tensor-parallel shards, grouped experts' slices) and keeps the ones a
name does express (a pipeline stage's layers, ``experts.<global index>``, FSDP2 shards as
DTensors with their offsets). The full format then gathers everything to rank 0; the
sharded format lets torch.distributed.checkpoint write each rank's pieces (keys several
ranks hold are written once). Loading a sharded checkpoint asks DCP, per name, for the
region of the stored full-shape tensor this rank holds (the same splits, as index ranges:
``lightning_5d.parallel.regions``) and reads it straight into the parameter or optimizer
state, so any layout reads any other's checkpoint without a full-shape copy of its names.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import functools
from concurrent.futures import Future
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_5d.checkpoint import files, full, sharded
from lightning_5d.checkpoint.lineage import STAMP_KEY, Branch
from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.export import hf_info
from lightning_5d.parallel.regions import FlatSlice, Region, dtensor_region, local_tensor, splits_region

log = logging.getLogger(__name__)


class CheckpointFormat(str, Enum):
    SHARDED = "sharded"  # a directory: every rank writes its pieces (torch.distributed.checkpoint)
    FULL = "full"  # one Lightning file, gathered to rank 0: loads anywhere, also without lightning_5d


class CheckpointWrite(str, Enum):
    SYNC = "sync"
    ASYNC = "async"  # the sharded format's files are written in a background thread


def checked_options(
    format: str | CheckpointFormat, write: str | CheckpointWrite, keep_last_k: int | None
) -> tuple[CheckpointFormat, CheckpointWrite, int | None]:
    """The checkpoint options, or a ValueError naming the bad value and the valid ones."""
    for value, kind in ((format, CheckpointFormat), (write, CheckpointWrite)):
        if value not in {m.value for m in kind} and not isinstance(value, kind):
            raise ValueError(f"{value!r} is not a {kind.__name__}; use one of {[m.value for m in kind]}.")
    format, write = CheckpointFormat(format), CheckpointWrite(write)
    if keep_last_k is not None and (not isinstance(keep_last_k, int) or keep_last_k < 1):
        raise ValueError(f"keep_last_k={keep_last_k!r}: keep at least 1 checkpoint, or None to keep all.")
    if write == CheckpointWrite.ASYNC and format != CheckpointFormat.SHARDED:
        raise ValueError("checkpoint_write='async' needs checkpoint_format='sharded'.")
    return format, write, keep_last_k


class _Pending:
    """An asynchronous save in flight: its future, whether publishing finished, and how it failed."""

    def __init__(self, future: Future) -> None:
        self.future, self.done, self.error = future, threading.Event(), None


class StoredState:
    """Stands in for the tensors of a sharded checkpoint in Lightning's checkpoint dict; the
    strategy reads them when Lightning asks it to restore the model or an optimizer."""

    def __init__(self, path: Path, index: int | None = None) -> None:
        self.path, self.index = path, index

    def __repr__(self) -> str:
        what = "model" if self.index is None else f"optimizer {self.index}"
        return f"StoredState({what} in {self.path})"


class StrategyCheckpoints:
    def __init__(
        self,
        strategy: Any,
        format: CheckpointFormat = CheckpointFormat.SHARDED,
        write: CheckpointWrite = CheckpointWrite.SYNC,
        keep_last_k: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.format, self.write, keep_last_k = checked_options(format, write, keep_last_k)
        self.keep_last_k = keep_last_k
        self._pending: _Pending | None = None
        self._deferred_removals: list[Any] = []
        self._rng_states: dict[str, Any] | None = None  # this rank's, restored when training starts
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

    # ------------------------------------------------------------------ what each rank holds
    @property
    def splits(self) -> list:
        """tp, ep and pp as they split this model (each has full_state / local_state)."""
        s = self.strategy
        return [x for x in (s._tp, s._ep, s._pp) if x is not None]

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
            state = _full_tensors(state)
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
                    state = {**state, "state": _per_stat(state["state"], _full_tensors, all_stats=True)}
            else:  # FSDP2, or no data-parallel peers: torch's own full format
                state = full.dcp_optimizer_state(s.lightning_module, optimizer, every_rank=bool(self.splits))
        if s._tp is not None:
            state = s._tp.full_optimizer_state(state)
        if s._ep is not None and s._ep.ep > 1:
            gather = functools.partial(s._ep.full_state, gather_listed=self.format == CheckpointFormat.FULL)
            state = {**state, "state": _per_stat(state["state"], gather)}
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
        self._raise_if(error, f"rank 0 could not write checkpoint {filepath}")

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
        self._raise_if(error, f"could not create {partial}")
        try:  # a rank that fails here must not leave the others waiting in the collectives below
            tensors = _tensors_of(checkpoint)
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta["optimizer_param_groups"] = [
                [{k: v for k, v in g.items() if k != "params"} for g in o["param_groups"]]
                for o in checkpoint.get("optimizer_states", [])
            ]
            meta["optimizer_nontensor_state"] = _nontensor_stats(checkpoint.get("optimizer_states", []))
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        self._raise_if(error, f"preparing checkpoint {final} failed")
        meta["rng_states"] = self._all_rng_states()
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
        self._raise_if(error, f"writing {final} failed")
        if s.is_global_zero:
            try:
                publish()
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        self._raise_if(error, f"rank 0 could not finish checkpoint {final}")

    def wait(self) -> None:
        """Block until an asynchronous save is on disk and published (or failed); then carry out
        the removals asked for meanwhile, which had to wait for the new checkpoint."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.done.wait()
        error = self._first_problem(pending.error)
        removals, self._deferred_removals = self._deferred_removals, []
        if error is not None:
            raise _failure("the asynchronous checkpoint save failed", error)
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

    # ------------------------------------------------------------------ load
    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        if files.is_local(path) and Path(path).is_dir():
            path = sharded.check_complete(path)
            meta = sharded.read_meta(path)
            groups = meta.get("optimizer_param_groups", [])
            checkpoint = {**meta, "state_dict": StoredState(path)}
            if "optimizer_states" in sharded.read_layout(path).get("contains", []):
                checkpoint["optimizer_states"] = [StoredState(path, i) for i in range(len(groups))]
            states, rank = meta.get("rng_states"), self.strategy.global_rank
            # Restored when training starts: setting up the data draws from the generators first.
            # A rank beyond the writer's world size keeps its seed.
            self._rng_states = states[rank] if states and rank < len(states) else None
            self._continue(meta.get(STAMP_KEY), path)
            return checkpoint
        if files.is_local(path) and Path(path).is_file():
            problem = files.damage(Path(path))
            if problem is not None:
                raise CheckpointError(f"checkpoint {path} is damaged: {problem}. Resume from an earlier one.")
        checkpoint = full.load_file(self.strategy.checkpoint_io, path, weights_only)
        self._continue(checkpoint.get(STAMP_KEY) if isinstance(checkpoint, Mapping) else None, path)
        return checkpoint

    def _continue(self, stamp: Any, path: Any) -> None:
        """Saves after this load continue the run that wrote ``path``, as its next start."""
        self._branch = Branch.resumed_from(stamp, job=_job_id())
        if self.strategy.is_global_zero:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            rank_zero_info(f"[lightning_5d] resuming run {self._branch.run} (start {self._branch.resume}) from {path}")

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        s = self.strategy
        state = checkpoint["state_dict"]
        if isinstance(state, StoredState):
            self._read_model(state.path, strict)  # each tensor's piece straight into its parameter
        else:  # a full-format file: its tensors are already in memory
            for split in self.splits:  # full tensors: this rank keeps its own pieces
                state = split.local_state(state)
            full.load_full_model_state(s.lightning_module, state, bool(s._fsdp_units), strict)
        self.after_model_load()

    def after_model_load(self) -> None:
        """Separate master copies (ZeRO-1/2 fp32 slices of bf16 parameters, bf16 precision's
        masters) take the parameters' new values."""
        s = self.strategy
        if s._zero is not None:
            s._zero.refresh_masters()
        if s._five_d_precision is not None:
            s._five_d_precision.refresh_masters()

    def _read_model(self, path: Path, strict: bool) -> None:
        """Every parameter and buffer of this rank reads its own region of the stored full-shape
        tensor: the tp / ep cuts narrowed to its FSDP2 shard (``lightning_5d.parallel.regions``).
        DCP reads the stored chunks those regions overlap, one at a time, into the live tensors:
        no full-shape copy of the rank's names, whatever layout wrote the checkpoint."""
        s = self.strategy
        stored = {
            k[len(sharded.MODEL) :]: v for k, v in sharded.tensor_shapes(path).items() if k.startswith(sharded.MODEL)
        }
        wanted = list(s.lightning_module.state_dict())
        problem = self._key_report(wanted, stored, path) if strict else None
        # Every rank learns of any rank's problem before the read, a collective all must enter.
        problem = self._first_problem(problem or self._shape_report(wanted, stored, path))
        if problem:
            raise CheckpointError(problem)
        live = s.lightning_module.state_dict(keep_vars=True)
        regions, seen = {}, set()
        for name in wanted:
            if name not in stored or id(live[name]) in seen:  # tied weights are read once
                continue
            seen.add(id(live[name]))
            region = dtensor_region(splits_region(name, stored[name][0], self.splits), live[name])
            regions[sharded.MODEL + name] = (region, local_tensor(live[name]).detach())
        with torch.no_grad():
            sharded.read_regions(path, regions)

    def _key_report(self, wanted: list[str], stored: Mapping[str, Any], path: Path) -> str | None:
        # Other ranks hold other stages / experts: a key is unexpected only if no rank wants it.
        everyone = [wanted]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, wanted)
        known = set().union(*everyone)
        missing = sorted(k for k in wanted if k not in stored)
        unexpected = sorted(k for k in stored if k not in known)
        if not missing and not unexpected:
            return None
        layout = sharded.read_layout(path)
        lines = [f"checkpoint {path} does not belong to this model (it was written by layout {layout.get('layout')}):"]
        if missing:
            lines.append(sharded.listing("missing", missing))
        if unexpected:
            lines.append(sharded.listing("unexpected", unexpected))
        lines.append("  Load it into the model that wrote it, or pass strict=False to load the matching part.")
        return "\n".join(lines)

    def _shape_report(self, wanted: list[str], stored: Mapping[str, Any], path: Path) -> str | None:
        """Cut the stored sizes the way loading will, and compare."""
        local = self.strategy.lightning_module.state_dict()
        pieces = {k: splits_region(k, stored[k][0], self.splits).local_shape for k in wanted if k in stored}
        wrong = [
            f"{k}: model {tuple(local[k].shape)}, checkpoint {shape} (this rank's piece)"
            for k, shape in pieces.items()
            if k in local and shape != tuple(local[k].shape)
        ]
        if not wrong:
            return None
        return (
            f"checkpoint {path} has tensors of other shapes than this model ({len(wrong)}): "
            f"{'; '.join(wrong[:6])}. It was written for another model configuration."
        )

    def _first_problem(self, problem: str | None) -> str | None:
        """The first rank's problem, on every rank (a collective)."""
        if not dist.is_initialized():
            return problem
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problem)
        return next((p for p in everyone if p is not None), None)

    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        s = self.strategy
        states = checkpoint["optimizer_states"]
        if len(states) != len(s.optimizers):
            raise CheckpointError(
                f"the checkpoint holds {len(states)} optimizer states but configure_optimizers returned "
                f"{len(s.optimizers)} optimizers."
            )
        for i, (optimizer, state) in enumerate(zip(s.optimizers, states)):
            with s._keyed_by_model_params(optimizer):
                try:
                    if isinstance(state, StoredState):  # read as each optimizer parameter holds it
                        state = self._read_optimizer(state.path, i, optimizer, checkpoint)
                        if s._zero is None:
                            full.load_named_optimizer_state(optimizer, state, self._param_names())
                        else:
                            s._zero.load_full_optimizer_state(optimizer, state, local=True)
                        continue
                    if s._ep is not None and s._ep.ep > 1:
                        state = {**state, "state": _per_stat(state["state"], s._ep.local_state)}
                    if s._tp is not None:
                        state = s._tp.local_optimizer_state(state)
                    if s._zero is None:
                        full.load_dcp_optimizer_state(s.lightning_module, optimizer, state)
                    else:
                        s._zero.load_full_optimizer_state(optimizer, state)
                except (ValueError, KeyError) as err:
                    raise CheckpointError(f"optimizer {i}'s state does not fit this optimizer: {err}") from err

    def _read_optimizer(self, path: Path, index: int, optimizer: Any, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """Optimizer ``index``'s state, each value at the size its parameter holds on this rank
        (a tp / ep piece, an FSDP2 shard as a DTensor, a ZeRO-1/2 flat slice as a DTensor), read
        straight from the stored full-shape tensors' regions."""
        names = self._param_names()
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        stored_groups = checkpoint["optimizer_param_groups"][index]
        problem = None
        if len(stored_groups) != len(groups):
            problem = (
                f"optimizer {index} in {path} has {len(stored_groups)} parameter groups, this one {len(groups)}; "
                f"configure_optimizers must build the same groups to resume."
            )
        problem = self._first_problem(problem)  # before the read, which every rank must enter
        if problem:
            raise CheckpointError(problem)
        prefix = f"{sharded.OPTIM}{index}.state."
        params = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
        regions: dict[str, tuple[Region, Tensor]] = {}
        finish: dict[str, Callable[[Tensor], Tensor]] = {}
        for key, (size, dtype) in sharded.tensor_shapes(path).items():
            if not key.startswith(prefix) or key[len(prefix) :].rsplit(".", 1)[0] not in params:
                continue
            name = key[len(prefix) :].rsplit(".", 1)[0]
            region, finish[key] = self._optimizer_region(name, params[name], tuple(size))
            regions[key] = (region, torch.empty(region.local_shape, dtype=dtype))
        sharded.read_regions(path, regions)
        state: dict[str, dict[str, Any]] = {}
        for key, (_, value) in regions.items():
            name, stat = key[len(prefix) :].rsplit(".", 1)
            state.setdefault(name, {})[stat] = finish[key](value)
        for name, stats in checkpoint.get("optimizer_nontensor_state", [{}] * (index + 1))[index].items():
            if name in params:
                state.setdefault(name, {}).update(stats)
        param_groups = [{**hyper, "params": g} for hyper, g in zip(stored_groups, groups)]
        return {"state": state, "param_groups": param_groups}

    def _optimizer_region(
        self, name: str, param: Tensor, size: tuple[int, ...]
    ) -> tuple[Region, Callable[[Tensor], Tensor]]:
        """Where an optimizer parameter's state value comes from in the stored tensor, and what
        turns the value read into what the optimizer holds. A 0-dim value (Adam's step) is whole."""
        if not size:
            return Region.whole(size), lambda value: value
        zero = self.strategy._zero
        region = splits_region(name, size, self.splits)
        flat = zero.flat_slice(param) if zero is not None else None
        if flat is not None:  # a ZeRO-1/2 master: a flat slice, read as its covering rows
            cut = FlatSlice(*flat)
            covering, start = cut.covering(region)
            return covering, lambda value: zero.from_flat(param, value.reshape(-1)[start : start + cut.length].clone())
        if isinstance(param, DTensor):  # an FSDP2 shard: the state is a DTensor like its parameter
            return dtensor_region(region, param), lambda value: DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        return region, lambda value: value

    def _param_names(self) -> dict[int, str]:
        s = self.strategy
        names = {id(p): n for n, p in s.lightning_module.named_parameters()}
        if s._zero is not None:
            names.update(s._zero.master_names())
        return names

    # ------------------------------------------------------------------ helpers
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

    def _all_rng_states(self) -> list[dict[str, Any]]:
        mine = _rng_state()
        if not dist.is_initialized():
            return [mine]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone

    def restore_rng(self) -> None:
        if self._rng_states is not None:
            _set_rng(self._rng_states)
            self._rng_states = None

    def _raise_if(self, error: str | None, what: str) -> None:
        """Raise on every rank if any rank has an error (a collective: a lone raising rank
        would leave the others waiting in the next one)."""
        error = self._first_problem(error)
        if error is not None:
            raise _failure(what, error)


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def _step(checkpoint: Mapping[str, Any], filepath: Any) -> int:
    step = checkpoint.get("global_step")
    return int(step) if isinstance(step, int) else files._step_of(Path(str(filepath)))


def _log_notes(notes: list[str]) -> None:
    for note in notes:
        log.warning("[lightning_5d] %s", note)


def _failure(what: str, error: str) -> CheckpointError:
    return CheckpointError(f"{what}: {error}. Nothing already on disk was changed.")


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


def _per_stat(
    state: dict[str, dict[str, Any]], convert: Callable[[dict[str, Any]], dict[str, Any]], all_stats: bool = False
) -> dict:
    """Apply a name-keyed model-state conversion (an ep split) to each optimizer statistic
    (scalars such as Adam's step only with ``all_stats``: they are not split)."""

    def takes(v: Any) -> bool:
        return isinstance(v, Tensor) and (all_stats or v.dim() > 0)

    out: dict[str, dict[str, Any]] = {n: dict(s) for n, s in state.items()}
    stats = sorted({k for s in state.values() for k, v in s.items() if takes(v)})
    for stat in stats:  # the same order on every rank: the conversions may be collectives
        converted = convert({n: s[stat] for n, s in state.items() if takes(s.get(stat))})
        for name, value in converted.items():
            out.setdefault(name, {})[stat] = value
    return out


def _full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


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


def _set_rng(state: Mapping[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
