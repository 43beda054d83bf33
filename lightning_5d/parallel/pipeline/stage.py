"""One torch pipeline stage as this runtime runs it: the time spent computing (for the bubble,
playbook's t_pp_bubble / t_step), the microbatches it holds, and stand-ins after a failure.

:class:`~.stages.PipelineParallel` builds one :class:`TimedStage` per stage this rank holds;
the stage reads the run's state (failures, current microbatch, activation shape) from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor
from torch.distributed.pipelining import PipelineStage

from .failure import StepFailures


class StageRuntime(Protocol):
    """What a stage reads from the runtime that owns it (:class:`~.stages.PipelineParallel`)."""

    failures: StepFailures
    current_microbatch: dict[int, int]  # stage index -> the microbatch its forward runs
    times: StageTimes
    _activation_meta: tuple[torch.Size, torch.dtype] | None  # a stand-in forward's output shape


@dataclass
class StageTimes:
    """Per-rank timings of one pipeline run: compute inside the stages vs the whole run.

    Wall-clock time: a rank waiting for a CPU core inside a computation counts as busy, so
    with more ranks than cores the bubble reads low (benchmarks/RESULTS.md, pipeline_bubble).
    """

    busy_s: float = 0.0
    wall_s: float = 0.0
    peak_in_flight: dict[int, int] = field(default_factory=dict)  # stage -> most microbatches held

    @property
    def bubble(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0


class TimedStage(PipelineStage):
    """torch's stage, plus the microbatch index the forward is for, timings, and stand-ins after a failure.

    Once a forward or backward on this rank raised (recorded in ``runtime.failures``), every
    later computation of the run on this rank is a stand-in: a forward leaves a zero activation
    (zero loss on the last stage) where torch's sends read it, a backward leaves no input
    gradient (torch sends zeros for it). The schedule's sends and receives all still happen, so
    the peers finish the run and learn of the failure at its end (:mod:`.failure`). The normal
    path pays one attribute test per computation.
    """

    def __init__(self, *args: Any, runtime: StageRuntime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._runtime = runtime
        self._held = 0

    def _timed(self, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self._runtime.times.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        failures = self._runtime.failures
        if not failures.failed:
            self._runtime.current_microbatch[self.stage_index] = fwd_chunk_id
            try:
                out = self._timed(
                    lambda: super(TimedStage, self).forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
                )
            except Exception as err:  # noqa: BLE001 - raised on every rank at the run's end (failure.py)
                failures.record(err, self.stage_index, fwd_chunk_id)
            else:
                if self.has_backward:
                    self._held += 1
                    peaks = self._runtime.times.peak_in_flight
                    peaks[self.stage_index] = max(peaks.get(self.stage_index, 0), self._held)
                return out
        return self._stand_in_forward(fwd_chunk_id, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        failures = self._runtime.failures
        if not failures.failed:
            self._held -= 1
            try:
                return self._timed(
                    lambda: super(TimedStage, self).backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
                )
            except Exception as err:  # noqa: BLE001 - as in forward_one_chunk
                failures.record(err, self.stage_index, bwd_chunk_id)
        self._stand_in_backward(bwd_chunk_id, full_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        failures = self._runtime.failures
        if not failures.failed:
            try:
                return self._timed(
                    lambda: super(TimedStage, self).backward_weight_one_chunk(bwd_chunk_id, last_backward)
                )
            except Exception as err:  # noqa: BLE001 - as in forward_one_chunk
                failures.record(err, self.stage_index, bwd_chunk_id)
        self.dw_runner.pop(bwd_chunk_id, None)
        self.backward_state.pop(bwd_chunk_id, None)

    def _stand_in_forward(self, chunk: int, save_forward_output: bool) -> Tensor:
        """What torch's forward would leave behind, without running the user's step: the output
        its sends (or the loss function, on the last stage) read, and a cache entry for the backward."""
        shape, dtype = self._runtime._activation_meta
        if self.is_last:
            out = torch.zeros((), device=self.device)
            if save_forward_output:
                self.output_chunks.append(out)
        else:
            out = torch.zeros(shape, dtype=dtype, device=self.device)
        self.fwd_cache[chunk] = ((out,), [])
        return out

    def _stand_in_backward(self, chunk: int, full_backward: bool) -> None:
        """No gradient for the previous stage (torch sends zeros in its place); nothing for the weights."""
        self.fwd_cache.pop(chunk, None)  # the graph of a forward that ran before the failure
        if not self.is_first:
            self.bwd_cache[chunk] = (None,)  # one activation in: the stage's only input
        if not full_backward:
            self.dw_runner[chunk] = lambda: None  # the schedule's W action for this chunk comes next
