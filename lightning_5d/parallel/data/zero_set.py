"""Several ZeRO engines driven as one: dense parameters and expert parameters reduce
over different groups, but the strategy starts, pauses and syncs them together."""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_5d.parallel.data.zero import ZeroDataParallel


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

    @property
    def slice_count(self) -> int:
        """Into how many slices the dense engine cuts each parameter (its shard group's size)."""
        return self.engines[0].shard_size

    def masters_by_name(self) -> dict[str, tuple[torch.Tensor | None, bool]]:
        """Name -> (master slice or None, whether that slice is the whole parameter), every engine's."""
        out: dict[str, tuple[torch.Tensor | None, bool]] = {}
        for e in self.engines:
            out.update({n: (m, e.shard_size == 1) for n, m in e.masters_by_name().items()})
        return out

    def master_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for e in self.engines:
            names.update(e.master_names())
        return names

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state keyed by parameter name, every slice gathered to its full shape:
        torch.distributed.checkpoint's full optimizer format, which FSDP2 writes and reads too,
        so checkpoints move between ZeRO stages."""
        state = optimizer.state_dict()
        params = _flat_params(optimizer)
        owners = [self._owner(p) for p in params]
        names = [e.name_of(p) for e, p in zip(owners, params)]
        full_state = {
            names[i]: {k: owners[i].full_value(params[i], v) for k, v in entry.items()}
            for i, entry in state["state"].items()
        }
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        return {"state": full_state, "param_groups": groups}

    def flat_slice(self, p: torch.Tensor) -> tuple[int, int] | None:
        return self._owner(p).flat_slice(p)

    def from_flat(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        return self._owner(p).from_flat(p, local)

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict, local: bool = False) -> None:
        """Load a name-keyed state: full-shape values (each rank keeps its slices), or with
        ``local=True`` values already cut to what each optimizer parameter holds."""
        params = _flat_params(optimizer)
        owners = [self._owner(p) for p in params]
        index = {e.name_of(p): i for i, (e, p) in enumerate(zip(owners, params))}
        if len(state["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this one "
                f"{len(optimizer.param_groups)}; configure_optimizers must build the same groups to resume."
            )
        unknown = sorted(set(state["state"]) - set(index))
        if unknown:
            raise ValueError(f"the checkpoint has optimizer state for unknown parameters {unknown[:3]}...")
        local_state = {}
        for name, entry in state["state"].items():
            i = index[name]
            local_state[i] = entry if local else {k: owners[i].local_value(params[i], v) for k, v in entry.items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
        optimizer.load_state_dict({"state": local_state, "param_groups": groups})

    def _owner(self, p: torch.Tensor) -> ZeroDataParallel:
        # A parameter no engine slices (a frozen one) is named by any engine: all see the whole module.
        return next((e for e in self.engines if e.holds(p)), self.engines[0])


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
