"""FSDP2 settings for the verifier's probe forward, so it holds one gathered unit at a time.

Training wants some units gathered after their forward (the last block, the norm + head unit,
the root: the backward needs them at once), and on GPU each block gathers the next one ahead of
its forward (explicit prefetch); the probe runs no backward and needs no overlap, so while it
lasts every unit gives its parameters back after its forward and prefetches nothing
(:func:`probe_settings`), and the settings are put back after it.

FSDP2 also keeps each unit's all-gather buffer (as large as the unit) alive in forward until the
next unit has copied its own out, to overlap the two on GPU streams: on CPU the probe held the
last block's buffer while the head unit gathered (buffer + unsharded weight). After each CPU
unit's forward, :func:`drop_kept_gather` lets it go (no stream can still be using it).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


class ProbeSettings:
    """What :func:`probe_settings` changed, to be put back by :meth:`restore`."""

    def __init__(self) -> None:
        self.reshard: list[tuple[Any, bool | None, list[Any]]] = []
        self.prefetch: list[tuple[Any, list[Any]]] = []

    def restore(self) -> None:
        for state, targets in self.prefetch:
            state._states_to_forward_prefetch = targets
        for state, auto, infos in self.reshard:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                # A root whose lazy init ran during the probe (its first forward) gets what that
                # init gives a root left on automatic: no reshard after forward.
                group.post_forward_mesh_info = None if auto and state._is_root else info


def probe_settings(units: Sequence[FSDPModule]) -> ProbeSettings:
    """Every unit reshards after its forward (see the module docstring)."""
    saved, seen = ProbeSettings(), set()
    for unit in units:
        state = fully_shard.state(unit)
        if id(state) in seen:
            continue  # one state for a list of modules sharded together
        seen.add(id(state))
        groups = state._fsdp_param_groups
        saved.reshard.append((state, state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in groups]))
        unit.set_reshard_after_forward(True, recurse=False)
        # An explicit forward prefetch (set on GPU) gathers the next unit while this one runs:
        # a second unit gathered, for an overlap the probe does not need.
        saved.prefetch.append((state, state._states_to_forward_prefetch))
        state._states_to_forward_prefetch = []
    return saved


def drop_kept_gather(unit: nn.Module) -> None:
    """After a CPU unit's forward: free the all-gather buffer FSDP2 keeps for the next unit."""
    if not isinstance(unit, FSDPModule):
        return
    state = fully_shard.state(unit)
    if all(group.device.type == "cpu" for group in state._fsdp_param_groups):
        state._comm_ctx.all_gather_state = None
