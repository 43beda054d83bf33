"""ZeRO-3 under a pipeline schedule: FSDP2 units that gather once per run and reduce once.

The schedule runs every microbatch's backward as its own autograd call, through our stage
module rather than an FSDP module, so torch's pipelining never sees FSDP. Left alone, FSDP
would reduce-scatter and reshard after each of those calls (m times per step). Instead the
units keep their parameters gathered and accumulate unsharded gradients for the whole run,
then every group reduces once, as torch's own stage does for a stage that *is* an FSDP module.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.fsdp import FSDPModule, fully_shard


def adopt_stage_units(units: Sequence[FSDPModule]) -> None:
    """Make the outermost unit the root of every unit of this rank, now, while the module holds
    the blocks of all its stages.

    FSDP2 finds its units when the root's first forward runs; under pp that forward holds only
    one stage's blocks, and each block of the rank's other stages would become a root of its own.
    A rank without an outer unit (a middle stage: no embedding, no head) keeps one root per block.
    """
    outer = units[-1]
    inside = {id(m) for m in outer.modules()}
    if all(id(u) in inside for u in units):
        fully_shard.state(outer)._lazy_init()


def hold_gradients(units: Sequence[FSDPModule]) -> None:
    """Before a schedule: keep parameters gathered and gradients unreduced across its backwards."""
    for unit in units:
        unit.set_is_last_backward(False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.set_requires_gradient_sync(False, recurse=False)


def reduce_held_gradients(units: Sequence[FSDPModule]) -> None:
    """After a schedule: reduce-scatter each unit's accumulated gradient once, then reshard."""
    for unit in units:
        unit.set_is_last_backward(True)
        unit.set_reshard_after_backward(True, recurse=False)
        unit.set_requires_gradient_sync(True, recurse=False)
    roots = {}
    for unit in units:
        state = fully_shard.state(unit)
        for group in state._fsdp_param_groups:
            group.post_backward()
        if state._is_root:
            roots[id(state)] = state
    for state in roots.values():
        state._root_post_backward_final_callback()  # waits for the reduce-scatters, resets the states
