"""A training run in which one rank's stage raised: every rank stops with that rank's error.

Under ``torch.distributed.pipelining`` a stage that raises leaves its peers blocked in a
point-to-point receive, and they see the process group's timeout instead of the real error.
Two pieces keep every rank moving instead:

* a rank whose stage raised keeps its place in the schedule: its remaining forwards and
  backwards are stand-ins (zero activations, no gradients; ``stage.TimedStage``), so every
  send and receive the schedule posts still happens and its peers finish the run;
* at the end of the run every rank of the world joins one all-reduce of a failure flag
  (:meth:`StepFailures.agree`); when it is set, every rank raises: the failing rank its own
  exception, the others a :class:`PipelinePeerError` naming the failing rank and its error.

Why a flag at the step boundary rather than one in every hand-off: the schedule's sends
and receives are torch's, batched per action; a flag in each would add a message per
hand-off (2·(S−1)·m per run), the flag adds one all-reduce of one integer per run. Over
the world rather than the pipe: a rank whose pipe failed would otherwise leave the data-
parallel peers of its pipe waiting in the gradient reduction after the step. Megatron-LM and
torchtitan leave this case to the process group's watchdog timeout.

What the flag cannot reach: a rank that fails inside a collective of its own stage (one
tensor-parallel rank of a stage raising while its tp peers are in an all-reduce) still leaves
those peers waiting; the hand-offs between stages and the step boundary are what it covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import PipelineError


class PipelinePeerError(PipelineError):
    """Another rank's pipeline stage failed; this rank stops with it instead of waiting for
    an activation or a gradient that will not come. ``rank``: the failing rank (global)."""

    def __init__(self, rank: int, message: str | None, during: str = "the forward") -> None:
        self.rank = rank
        detail = f": {message}" if message else " (its own error says why)"
        super().__init__(f"the pipeline stage on rank {rank} failed during {during}{detail}")


@dataclass(frozen=True)
class StageFailure:
    """Where a rank's run failed: ``stage`` and ``microbatch`` are None outside the schedule."""

    error: BaseException
    stage: int | None
    microbatch: int | None

    def describe(self) -> str:
        where = "" if self.stage is None else f" (stage {self.stage}, microbatch {self.microbatch})"
        return f"{type(self.error).__name__}: {self.error}{where}"


def original_error(error: BaseException) -> BaseException:
    """The user's exception inside torch's wrapper: the stage re-raises a forward's or a
    backward's error as ``RuntimeError(...) from error``; the user should see the error itself."""
    return error.__cause__ if isinstance(error, RuntimeError) and error.__cause__ is not None else error


class StepFailures:
    """This rank's first failure in the current training run, and the run's end where every rank learns of all."""

    def __init__(self) -> None:
        self.own: StageFailure | None = None

    @property
    def failed(self) -> bool:
        return self.own is not None

    def record(self, error: BaseException, stage: int | None = None, microbatch: int | None = None) -> None:
        """Keep the first failure only: later ones on this rank follow from it (stand-ins, not work)."""
        if self.own is None:
            self.own = StageFailure(original_error(error), stage, microbatch)

    def agree(self, device: torch.device) -> None:
        """Collective over the world, once per run: raise on every rank if any rank failed.

        The normal run pays one all-reduce of one integer; the failure path gathers every
        failing rank's description (a pickle per rank, only then).
        """
        own, self.own = self.own, None
        flag = torch.tensor([0 if own is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag)
        if int(flag.item()) == 0:
            return
        me = dist.get_rank()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, None if own is None else (me, own.describe()))
        failures = [g for g in gathered if g is not None]
        if own is not None:
            others = [f"rank {r}: {text}" for r, text in failures if r != me]
            where = "" if own.stage is None else f" in pipeline stage {own.stage}, microbatch {own.microbatch}"
            note = f"raised on rank {me}{where}; every other rank stopped with a PipelinePeerError naming it"
            own.error.add_note(note + (f" (also failed: {'; '.join(others)})" if others else ""))
            raise own.error
        rank, text = failures[0]
        also = [f"rank {r}: {t}" for r, t in failures[1:]]
        raise PipelinePeerError(rank, text + (f" (also failed: {'; '.join(also)})" if also else ""), "the training step")
