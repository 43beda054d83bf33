"""ZeRO-3 under a pipeline schedule: FSDP2 units that reduce-scatter once per run.

The schedule runs every microbatch's backward as its own autograd call, through our stage
module rather than an FSDP module, so torch's pipelining never sees FSDP. Left alone, FSDP
would reduce-scatter after each of those calls (m times per run). Instead the units accumulate
unsharded gradients for the whole run and stay gathered after each backward, then every group
reduces once, as torch's own stage does for a stage that *is* an FSDP module. The price is
memory while the run lasts: the rank's full gradients (in the reduce dtype) and, by the end,
its gathered parameters; the planner counts both (estimate/memory.py, buffer_bytes).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_5d.heap import release_freed_memory


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


def _set_holding(units: Sequence[FSDPModule], holding: bool) -> None:
    for unit in units:
        unit.set_is_last_backward(not holding)
        unit.set_reshard_after_backward(not holding, recurse=False)
        unit.set_requires_gradient_sync(not holding, recurse=False)


def hold_gradients(units: Sequence[FSDPModule]) -> None:
    """Before a schedule: keep parameters gathered and gradients unreduced across its backwards."""
    _set_holding(units, True)


def drop_held_gradients(units: Sequence[FSDPModule]) -> None:
    """After a schedule that raised: forget its partial gradients, back to sharded parameters.

    Otherwise a later run in the same process (fit again) would reduce them with its own.
    """
    _set_holding(units, False)
    for unit in units:
        state = fully_shard.state(unit)
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                param.unsharded_param.grad = None
        if state._is_root:
            unit.reset_iter_state()  # waits for collectives in flight, reshards, resets the states


def reset_stopped_forward(module: nn.Module) -> None:
    """After a forward stopped by an exception (the shape probe's stop at the first block's input).

    FSDP2's pre-forward hook on that block runs before the stop (it is registered first, and
    tp's sequence scatter, whose output shape the probe wants, runs between the two), so the
    block's unit was gathered, and its post-forward, which reshards it, never ran: the unit stayed
    gathered (its parameters plus the all-gather buffer FSDP2 keeps for the next unit, on a 0.5 B
    model 2 x 96 MiB) while the first microbatch gathered the embedding (measured: the first
    stage's start-up peak). Each root's ``reset_iter_state`` (FSDP2's recovery after an aborted
    forward) reshards every unit, drops that buffer and the half-run iteration's state. Nothing
    is lost: no gradient exists before the schedule that follows. The block's gathered matrices
    (below glibc's 32 MiB mmap threshold) then go back to the OS, or RSS keeps them (measured:
    the reset alone left the peak unchanged).
    """
    roots = fsdp_roots(module)
    for unit in roots:
        unit.reset_iter_state()
    if roots:
        release_freed_memory()


def fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """The ZeRO-3 root units in ``module`` (one per pipeline stage's model; FSDP2's recovery,
    ``reset_iter_state``, runs on those), once their lazy init has named them roots."""
    return [u for u in module.modules() if isinstance(u, FSDPModule) and fully_shard.state(u)._is_root]


def reduce_held_gradients(units: Sequence[FSDPModule]) -> None:
    """After a schedule: reduce-scatter each unit's accumulated gradient once, then reshard."""
    _set_holding(units, False)
    roots = {}
    for unit in units:
        state = fully_shard.state(unit)
        for group in state._fsdp_param_groups:
            group.post_backward()
        if state._is_root:
            roots[id(state)] = state
    for state in roots.values():
        state._root_post_backward_final_callback()  # waits for the reduce-scatters, resets the states
