"""The pipeline inside Lightning's loop: one Lightning batch as one pipeline run, and the
gradients that run made, held past Lightning's ``zero_grad`` until the strategy's backward.

Lightning zeroes gradients after the step and before backward, but the schedule runs every
microbatch's backward inside the step. So the schedule's gradients wait outside the
parameters until :meth:`PipelineLoop.restore_gradients`, where ZeRO reduces them once.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_5d.layout_rules import Combination, loss_scaling_pp, zero3_split_backward
from lightning_5d.parallel.pipeline.stages import PipelineMode, PipelineParallel
from lightning_5d.parallel.pipeline.batch import PipelineError, apply_logs
from lightning_5d.parallel.pipeline.fsdp import drop_held_gradients, hold_gradients, reduce_held_gradients


def check_pipeline_supported(module: nn.Module, combination: Combination) -> None:
    """Refuse what the pipeline loop cannot run; layout-only rules come from ``layout_rules``."""
    why = loss_scaling_pp(combination)
    if why is not None:
        raise PipelineError(why)
    if not module.automatic_optimization:
        raise PipelineError(
            "pp > 1 needs automatic optimization: the pipeline schedule runs every microbatch's backward, so "
            "a training_step that calls manual_backward cannot run under it. Use pp=1 for this module."
        )
    why = zero3_split_backward(combination)
    if why is not None:
        raise PipelineError(why)


class PipelineLoop:
    def __init__(self, pipeline: PipelineParallel, log_bubble: bool) -> None:
        self.pipeline = pipeline
        self.log_bubble = log_bubble
        self._grads: dict[nn.Parameter, torch.Tensor] = {}

    def run(
        self,
        mode: PipelineMode,
        step: Callable[[Any], Any],
        batch: Any,
        *,
        zero: Any,
        fsdp_units: Sequence[Any],
        cp: Any,
        step_region: Callable[[], AbstractContextManager],
        device: torch.device,
    ) -> Any:
        """Run ``step`` per microbatch on each stage; ``zero``/``cp`` are the strategy's engines or None,
        ``fsdp_units`` its ZeRO-3 units (empty below ZeRO-3)."""
        module = self.pipeline.module
        earlier: dict = {}
        if mode == PipelineMode.TRAIN:
            trainer = module.trainer
            self.pipeline.loss_scale = 1.0 / trainer.accumulate_grad_batches
            # The schedule divides every gradient it finds by m, so gradients of earlier runs in
            # this accumulation window wait outside; the window's first run starts from zero.
            # The epoch loop's index, as Lightning's own zero_grad uses: the step may not take batch_idx.
            if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches != 0:
                earlier = {p: p.grad for p in module.parameters() if p.grad is not None}
            for p in module.parameters():
                p.grad = None
        if zero is not None:
            zero.paused = True  # the schedule's many backwards: reduce once, afterwards
        held = mode == PipelineMode.TRAIN and bool(fsdp_units)
        if held:
            hold_gradients(fsdp_units)
        if cp is not None:
            batch = cp.begin(batch)  # the sequence shard first, then its microbatches
        try:
            with step_region():
                out, logged = self.pipeline.run(mode, step, batch)
                if held:
                    reduce_held_gradients(fsdp_units)
                    held = False
                if mode == PipelineMode.TRAIN and self.log_bubble:
                    logged = [*logged, ("pp_bubble", self.pipeline.mean_bubble(), {"prog_bar": False})]
                apply_logs(module, logged, device)  # inside: cp's token weighting applies too
        finally:
            if held:  # the run raised before its reduce
                drop_held_gradients(fsdp_units)
            if zero is not None:
                zero.paused = False
            if cp is not None:
                cp.end()
        if mode == PipelineMode.TRAIN:
            # This run's own gradients (before the window's earlier ones join): summing them per
            # run keeps the tied copies equal under any accumulation.
            self.pipeline.tied.sum_gradients(self.pipeline.module)
            # Out of reach of Lightning's zero_grad until restore_gradients puts them back.
            grads = {p: p.grad for p in module.parameters() if p.grad is not None}
            for p in grads:
                p.grad = None
            for p, g in earlier.items():
                grads[p] = g if p not in grads else grads[p] + g
            self._grads = grads
        return out

    def restore_gradients(self) -> None:
        for p, g in self._grads.items():
            p.grad = g
        self._grads = {}
