"""The reading half of the 5D strategy's checkpoints: any layout reads any other's.

Loading a sharded checkpoint asks DCP, per name, for the region of the stored full-shape
tensor this rank holds (the same splits the writer undid, as index ranges:
``lightning_5d.parallel.regions``) and reads it straight into the parameter or optimizer
state, so any layout reads any other's checkpoint without a full-shape copy of its names. A
full-format file is in memory already: each split keeps this rank's pieces of it. Every
rank learns of any rank's problem (missing keys, other shapes) before a read all of them
must enter. Writing: :mod:`lightning_5d.checkpoint.strategy_writer`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_5d.checkpoint import files, full, optimizer_groups, sharded
from lightning_5d.checkpoint.errors import CheckpointError, first_problem
from lightning_5d.checkpoint.lineage import STAMP_KEY, Branch
from lightning_5d.checkpoint.strategy_state import per_stat, split_dims
from lightning_5d.parallel.regions import FlatSlice, Region, dtensor_region, local_tensor, splits_region


class StoredState:
    """Stands in for the tensors of a sharded checkpoint in Lightning's checkpoint dict; the
    strategy reads them when Lightning asks it to restore the model or an optimizer."""

    def __init__(self, path: Path, index: int | None = None) -> None:
        self.path, self.index = path, index

    def __repr__(self) -> str:
        what = "model" if self.index is None else f"optimizer {self.index}"
        return f"StoredState({what} in {self.path})"


class StoredModelState(StoredState, Mapping):
    """The model's tensors of a sharded checkpoint, as ``checkpoint["state_dict"]`` in Lightning's
    load hooks: a read-only mapping of the stored names to their full tensors.

    A user's ``on_load_checkpoint`` (the module's or a callback's) reads it as it would a dict
    (Lightning's ``WeightAveraging`` builds its averaged model from it; a key check, a norm).
    Names and shapes come from the checkpoint's metadata; a tensor is read whole, on access, by
    this rank alone (no collective: any rank may ask), one at a time. Left as it is, the strategy
    reads each rank's pieces straight into the parameters; a hook that replaces it with a dict of
    full tensors (renamed keys) has that dict loaded instead."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self._handed: dict[str, tuple[Tensor, int]] = {}  # name -> (tensor handed out, its version then)

    def _stored(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        if self._shapes is None:
            shapes = sharded.tensor_shapes(self.path)
            self._shapes = {k[len(sharded.MODEL) :]: v for k, v in shapes.items() if k.startswith(sharded.MODEL)}
        return self._shapes

    def __getitem__(self, name: str) -> Tensor:
        size, dtype = self._stored()[name]
        out = torch.empty(size, dtype=dtype)
        sharded.read_tensors_alone(self.path, {sharded.MODEL + name: out})
        self._handed[name] = (out, out._version)
        return out

    def __iter__(self):
        return iter(self._stored())

    def __len__(self) -> int:
        return len(self._stored())

    def __contains__(self, name: object) -> bool:
        return name in self._stored()  # from the metadata: nothing is read

    def edited(self) -> str | None:
        """A tensor a hook was handed and changed in place (the strategy reads the stored one)."""
        changed = sorted(name for name, (tensor, version) in self._handed.items() if tensor._version != version)
        if not changed:
            return None
        return (
            f"a load hook changed {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''} of "
            f"checkpoint['state_dict'] in place, "
            f"but the model state of the sharded checkpoint {self.path} is read from disk into each rank's pieces "
            f"of the parameters, so the change would be lost. Replace the dict instead, e.g. "
            f"checkpoint['state_dict'] = {{k: fix(k, v) for k, v in checkpoint['state_dict'].items()}}: that dict of "
            f"full tensors is then loaded."
        )

    def __setitem__(self, name: str, value: Any) -> None:
        self._refuse_change(f"checkpoint['state_dict'][{name!r}] = ...")

    def __delitem__(self, name: str) -> None:
        self._refuse_change(f"del checkpoint['state_dict'][{name!r}]")

    def pop(self, name: str, *default: Any) -> Any:
        self._refuse_change(f"checkpoint['state_dict'].pop({name!r})")

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_change("checkpoint['state_dict'].update(...)")

    def setdefault(self, name: str, default: Any = None) -> Any:
        self._refuse_change(f"checkpoint['state_dict'].setdefault({name!r}, ...)")

    def clear(self) -> None:
        self._refuse_change("checkpoint['state_dict'].clear()")

    def popitem(self) -> Any:
        self._refuse_change("checkpoint['state_dict'].popitem()")

    def _refuse_change(self, what: str) -> None:
        raise CheckpointError(
            f"{what}: the model state of the sharded checkpoint {self.path} is read from disk into each rank's "
            f"pieces of the parameters and cannot be changed in place. Replace it instead, e.g. "
            f"checkpoint['state_dict'] = {{new_name(k): v for k, v in checkpoint['state_dict'].items()}}: that dict "
            f"of full tensors is then loaded (every rank reads every tensor whole for it)."
        )


class CheckpointReader:
    """Lightning's load hooks: the checkpoint dict (``load``), then the model's and the optimizers'
    state into this layout, and each rank's random generators when training starts.

    ``on_resume``: given the loaded checkpoint's lineage stamp, returns the branch later saves
    continue (the writer's, ``CheckpointWriter.continue_from``)."""

    def __init__(self, strategy: Any, on_resume: Callable[[Any], Branch]) -> None:
        self.strategy = strategy
        self.on_resume = on_resume
        self._rng_states: dict[str, Any] | None = None  # this rank's, restored when training starts

    @property
    def splits(self) -> list:
        return split_dims(self.strategy)

    # ------------------------------------------------------------------ load
    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        if files.is_local(path) and Path(path).is_dir():
            path = sharded.check_complete(path)
            meta = sharded.read_meta(path)
            groups = meta.get("optimizer_param_groups", [])
            checkpoint = {**meta, "state_dict": StoredModelState(path)}
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
        branch = self.on_resume(stamp)
        if self.strategy.is_global_zero:
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            rank_zero_info(f"[lightning_5d] resuming run {branch.run} (start {branch.resume}) from {path}")

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        s = self.strategy
        state = checkpoint["state_dict"]
        if isinstance(state, StoredState):
            edited = state.edited() if isinstance(state, StoredModelState) else None
            self._read_model(state.path, strict, edited)  # each tensor's piece straight into its parameter
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

    def _read_model(self, path: Path, strict: bool, edited: str | None = None) -> None:
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
        problem = first_problem(edited or problem or self._shape_report(wanted, stored, path))
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
                        state = {**state, "state": per_stat(state["state"], s._ep.local_state)}
                    if s._tp is not None:
                        state = s._tp.local_optimizer_state(state)
                    if s._zero is None:
                        full.load_dcp_optimizer_state(s.lightning_module, optimizer, state)
                    else:
                        s._zero.load_full_optimizer_state(optimizer, state)
                except (ValueError, KeyError) as err:
                    raise CheckpointError(f"optimizer {i}'s state does not fit this optimizer: {err}") from err
        # Lightning restores the schedulers next, from this checkpoint's states (rank 0's).
        if checkpoint.get("optimizer_param_group_of") is not None:
            schedulers = s.lightning_module.trainer.lr_scheduler_configs
            for config, state in zip(schedulers, checkpoint.get("lr_schedulers") or []):
                optimizer_groups.follow_groups(state, config.scheduler.optimizer.param_groups)

    def _read_optimizer(self, path: Path, index: int, optimizer: Any, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """Optimizer ``index``'s state, each value at the size its parameter holds on this rank
        (a tp / ep piece, an FSDP2 shard as a DTensor, a ZeRO-1/2 flat slice as a DTensor), read
        straight from the stored full-shape tensors' regions."""
        names = self._param_names()
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        stored_groups, problem = self._stored_group_options(path, index, optimizer, groups, checkpoint)
        problem = first_problem(problem)  # before the read, which every rank must enter
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

    @staticmethod
    def _stored_group_options(
        path: Path, index: int, optimizer: Any, groups: list[list[str]], checkpoint: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The saved options of each of this rank's parameter groups (checkpoint/optimizer_groups.py)."""
        stored = checkpoint["optimizer_param_groups"][index]
        group_of = (checkpoint.get("optimizer_param_group_of") or [None] * (index + 1))[index]
        if group_of is None:  # written before the groups were recorded by name: rank 0's, by position
            if len(stored) == len(groups):
                return stored, None
            return stored, (
                f"optimizer {index} in {path} has {len(stored)} parameter groups, this one {len(groups)}; "
                f"configure_optimizers must build the same groups to resume."
            )
        own = [({k: v for k, v in g.items() if k != "params"}, names) for g, names in zip(optimizer.param_groups, groups)]
        options, problem = optimizer_groups.stored_options(own, stored, group_of)
        if problem is not None:
            return [], f"optimizer {index} in {path}: {problem}"
        return options, None

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

    def restore_rng(self) -> None:
        if self._rng_states is not None:
            _set_rng(self._rng_states)
            self._rng_states = None


def _set_rng(state: Mapping[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
