"""Where the forward uses parameters that belong to no part of the plan.

``self.positions = nn.Parameter(...)`` held on the model beside the embedding and added to its
output is no module the plan can name, yet pipeline parallelism must put it on a stage. The
forward's order tells which: the model runs once on probe ids while a torch function mode
notes every call that reads such a parameter, and hooks on the modules inside the blocks mark
the phase:

    BEFORE  no module of any block has started yet            -> the first stage (with the embedding)
    AMONG   between the first block's start and the last one's end
    AFTER   the last block's modules have all returned         -> the last stage (with the head)

Every phase a parameter was read in is recorded; only a parameter read in one phase, BEFORE
or AFTER, has a stage of its own. Parameters of the plan's parts and of the blocks are not
watched.
"""

from __future__ import annotations

from collections.abc import Callable
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.plan.model_plan import Phase


class _Watch(TorchFunctionMode):
    def __init__(self, loose: dict[int, str], seen: dict[str, set[Phase]], phase: list[Phase]) -> None:
        super().__init__()
        self.loose, self.seen, self.phase = loose, seen, phase

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, Tensor) and id(value) in self.loose:
                self.seen.setdefault(self.loose[id(value)], set()).add(self.phase[0])
        return func(*args, **(kwargs or {}))


def loose_parameter_uses(
    root: nn.Module, blocks: list[nn.Module], loose: dict[str, nn.Parameter], run: Callable[[], bool]
) -> dict[str, frozenset[Phase]] | None:
    """Parameter name -> the phases it was read in (names never read are left out); None when
    the model did not run on probe ids."""
    by_id = {id(p): name for name, p in loose.items()}
    seen: dict[str, set[Phase]] = {}
    phase = [Phase.BEFORE]
    handles = []

    def started(*_):
        phase[0] = Phase.AMONG

    def finished(*_):
        phase[0] = Phase.AFTER  # the next module of a block to start sets AMONG again

    for block in blocks:
        for module in block.modules():
            handles.append(module.register_forward_pre_hook(started))
    # The last block's end: the block's own return, or for a container the model iterates
    # (no forward of its own), each of its entries' (the next entry's start sets AMONG again).
    # Not its inner layers: a parameter read inside the block's forward is read among the blocks.
    last = blocks[-1]
    ends = list(last.children()) if isinstance(last, (nn.ModuleList, nn.ModuleDict)) else [last]
    handles += [m.register_forward_hook(finished) for m in ends]
    try:
        with torch.no_grad(), _Watch(by_id, seen, phase):
            ran = run()
    finally:
        for h in handles:
            h.remove()
    if not ran:
        return None
    return {name: frozenset(p) for name, p in seen.items()}
