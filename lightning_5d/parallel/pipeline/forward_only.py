"""Validation, test, predict (and the plan verifier's probe) under pp: every microbatch
forward through the stages in order, each hand-off carrying a failure flag.

Not torch's ``eval()``: its V schedules still run their backward actions' local hand-offs
with backward off. Here each stage sends its outputs as it makes them (non-blocking) and the
next stage's rank receives them in the same global order.

Each hand-off is a flag (0, or the failing rank + 1) followed by the activation only when
the flag is 0: a stage whose forward raised (the plan verifier's probe of a block that cannot
run under tp) keeps sending flags instead of leaving the next stage's rank blocked in a
receive; the last stage's rank then tells every stage (in the results' broadcast,
``stages.PipelineParallel``), so every pipeline rank raises, none waits for a peer that has
gone. Training runs use torch's schedules instead, whose failure path is :mod:`.failure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .failure import PipelinePeerError

Failure = tuple[int, "str | None"]  # (global rank, message when it is this rank's own)


@dataclass
class ForwardOnlyOutcome:
    failed: Failure | None = None
    own: Exception | None = None  # this rank's exception, re-raised here rather than a peer's echo


@dataclass
class ForwardOnlyRun:
    """One forward-only run of m microbatches over this rank's stages.

    ``stages``: this rank's stage forwards by global stage index (activation in, out);
    ``owner``: the pipeline rank of every stage; ``rank``: this rank's pipeline rank;
    ``activation``: the static (shape, dtype) of every hand-off; ``current_microbatch``:
    written before each stage's forward, where the stage reads which microbatch it runs.
    """

    stages: Mapping[int, Callable[[Tensor], Tensor]]
    owner: Sequence[int]
    rank: int
    microbatches: int
    group: dist.ProcessGroup
    device: torch.device
    activation: tuple[torch.Size, torch.dtype]
    current_microbatch: dict[int, int] = field(default_factory=dict)

    def run(self) -> ForwardOnlyOutcome:
        shape, dtype = self.activation
        num_stages = len(self.owner)
        pending = []
        local: dict[tuple[int, int], Tensor | None] = {}
        me = dist.get_rank()
        outcome = ForwardOnlyOutcome()
        for s in range(num_stages):
            if self.owner[s] != self.rank:
                continue
            for mb in range(self.microbatches):
                x: Tensor | None
                if s == 0:
                    x = torch.zeros(1, dtype=torch.long, device=self.device)
                elif self.owner[s - 1] == self.rank:
                    x = local.pop((s - 1, mb))  # None after this rank's own earlier stage failed
                else:
                    x = self._receive(s, shape, dtype, outcome)
                out = None
                if x is not None and outcome.failed is None:
                    self.current_microbatch[s] = mb
                    try:
                        out = self.stages[s](x)
                    except Exception as err:  # noqa: BLE001 - re-raised by raise_failure, after the flags went out
                        outcome.own, outcome.failed = err, (me, f"{type(err).__name__}: {err}")
                if s == num_stages - 1:
                    continue
                if self.owner[s + 1] == self.rank:
                    local[(s, mb)] = out
                else:
                    pending.extend(self._send(s, out, outcome))
        for work in pending:
            work.wait()
        return outcome

    def _receive(self, s: int, shape: torch.Size, dtype: torch.dtype, outcome: ForwardOnlyOutcome) -> Tensor | None:
        """The flag from stage s-1's rank, then its activation if the flag says it has one."""
        flag = torch.zeros(1, dtype=torch.long, device=self.device)
        dist.recv(flag, group=self.group, group_src=self.owner[s - 1])
        if int(flag.item()) == 0:
            x = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.owner[s - 1])
            return x
        if outcome.failed is None:
            outcome.failed = (int(flag.item()) - 1, None)
        return None

    def _send(self, s: int, out: Tensor | None, outcome: ForwardOnlyOutcome) -> list:
        code = 0 if out is not None else outcome.failed[0] + 1
        flag = torch.tensor([code], dtype=torch.long, device=self.device)
        works = [dist.isend(flag, group=self.group, group_dst=self.owner[s + 1])]
        if out is not None:
            works.append(dist.isend(out.contiguous(), group=self.group, group_dst=self.owner[s + 1]))
        return works


def raise_failure(failed: Failure, own: Exception | None) -> None:
    """Every pipeline rank, once the last stage's rank has shared ``failed``: this rank's own
    exception where it raised one, else a :class:`PipelinePeerError` naming the failing rank."""
    if own is not None:
        raise own
    raise PipelinePeerError(*failed)
