"""The FP8 numerics guard inside a training step: every ``numerics_check_every`` optimizer
steps, the step's forward runs once more with every FP8 linear in bf16, and the relative
difference of the two losses is logged as ``fp8/loss_rel_diff`` (with a warning past
``numerics_threshold``). The strategy calls these around the real step; the precision
plugin (``FiveDPrecision.fp8_off`` / ``check_numerics``) does the switching and comparing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_5d.parallel.step_log import shadowed


def numerics_check_due(precision: Any, trainer: Any, automatic: bool) -> bool:
    """Under FP8 with automatic optimization, on the first micro-batch of a step the guard picks."""
    if precision is None or precision.fp8 is None or not automatic:
        return False
    return precision.guard.due(trainer.global_step) and _first_micro_batch(trainer)


def loss_without_fp8(precision: Any, module: nn.Module, run_step: Callable[[], Any], device: torch.device) -> float | None:
    """The step's loss with FP8 off, computed without gradients, logging or a change to the random streams."""
    quiet = lambda *a, **k: None  # noqa: E731  (the check must not log the user's metrics twice)
    devices = [device] if device.type == "cuda" else []
    with shadowed(module, "log", lambda _own: quiet), shadowed(module, "log_dict", lambda _own: quiet):
        # The same random state as the real step: dropout masks match, and training's stream is untouched.
        with torch.random.fork_rng(devices=devices), torch.no_grad(), precision.fp8_off():
            out = run_step()
    loss = step_loss(out)
    return None if loss is None else float(loss)


def log_numerics(precision: Any, module: Any, out: Any, reference: float, warn: bool) -> None:
    loss = step_loss(out)
    if loss is None:
        return
    rel = precision.check_numerics(float(loss.detach()), reference, warn=warn)
    module.log("fp8/loss_rel_diff", rel, sync_dist=True, on_step=True, on_epoch=False)


def step_loss(out: Any) -> Tensor | None:
    """The loss a training_step returned (a tensor, or a dict's "loss"), None if it returned none."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
        return out["loss"]
    return None


def _first_micro_batch(trainer: Any) -> bool:
    """Whether this batch opens an optimizer step (the numerics check runs once per step)."""
    return (trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1) % trainer.accumulate_grad_batches == 0
