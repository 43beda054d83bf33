"""One Lightning batch in, one step's result out: what the pipeline does with the user's data.

The batch is cut into microbatches along dim 0; afterwards the last stage's per-microbatch
step outputs and ``self.log`` values become one output and one value per name, which every
pipeline rank then returns and logs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_5d.config import LayoutError
from lightning_5d.parallel.step_log import reduce_fx_name


class PipelineError(LayoutError):
    """A model or a step the pipeline cannot honour; the message says what to change."""


def split_microbatches(batch: Any, m: int) -> list[Any]:
    """m microbatches of a batch (tensors cut along dim 0; other values shared)."""
    sizes = set()

    def collect(x: Any) -> None:
        if isinstance(x, Tensor) and x.dim() > 0:
            sizes.add(x.size(0))
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(batch)
    for b in sizes:
        if b % m:
            raise PipelineError(
                f"a batch of {b} samples does not split into pipeline.microbatches={m}; make the DataLoader's "
                f"batch size a multiple of {m} (and drop_last=True, so the epoch's last batch is full too), "
                f"or set microbatches to a divisor of {b}."
            )

    def cut(x: Any, i: int) -> Any:
        if isinstance(x, Tensor) and x.dim() > 0:
            return x.chunk(m)[i]
        if isinstance(x, dict):
            return type(x)({k: cut(v, i) for k, v in x.items()})
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(cut(v, i) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v, i) for v in x)
        return x

    return [cut(batch, i) for i in range(m)]


def _shapes(x: Any) -> tuple:
    if isinstance(x, Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, dict):
        return tuple((k, _shapes(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    return ()


def _loss_of(result: Any, device: torch.device) -> Tensor:
    loss = result.get("loss") if isinstance(result, dict) else result
    if isinstance(loss, Tensor) and loss.dim() == 0:
        return loss
    if loss is None:
        # a forward-only step (validation) may return nothing; the pipeline still needs a value
        return torch.zeros((), device=device)
    raise PipelineError(
        f"under pp the step must return a scalar loss tensor (or a dict with 'loss'), got {type(loss).__name__}; "
        f"returning None to skip a batch is not possible mid-pipeline."
    )


def _to_number(name: str, value: Any) -> float | int:
    """A logged scalar as a number to send; an integer (a count of the microbatch's samples or
    tokens) stays an int, so that the microbatches' counts are summed (``_combine_logs``)."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise PipelineError(f"self.log({name!r}) under pp needs a scalar, got shape {tuple(value.shape)}")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            return float(value.detach().float())
        return int(value.detach())
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return value
    raise PipelineError(
        f"self.log({name!r}, {type(value).__name__}) inside a pipelined step: only numbers and scalar tensors can "
        f"be sent from the last stage to the other ranks; log metric objects from a hook such as "
        f"on_train_batch_end instead."
    )


_REDUCE = {"sum": sum, "max": max, "min": min}


def _weighted_mean(values: list[float], weights: list[float] | None) -> float:
    """The microbatches' mean, weighted by the targets each counts where those are known (one per value)."""
    if weights is None or len(weights) != len(values) or sum(weights) <= 0:
        return sum(values) / len(values)
    return sum(w * v for w, v in zip(weights, values) if w) / sum(weights)


def _combine_logs(
    per_microbatch: list[list[tuple[str, float | int, dict]]], weights: list[float] | None = None
) -> list[tuple[str, float, dict]]:
    """One value per name over the microbatches, by the log call's own ``reduce_fx`` (mean by default).

    Integers are counts of their microbatch: the batch's count is their sum, under the default
    mean too (one process logs the whole batch's count). A float count logged with the mean
    cannot be told from a mean and is averaged (docs/pipeline_parallel.md). ``weights``: the
    targets each microbatch's cross-entropy counted (parallel/token_mean.py): a mean logged once
    by every microbatch is weighted by them, as one process's mean over the whole batch."""
    values: dict[str, list[float]] = {}
    logged_in: dict[str, list[int]] = {}  # which microbatch logged each value
    options: dict[str, dict] = {}
    for microbatch, records in enumerate(per_microbatch):
        for name, value, kwargs in records:
            values.setdefault(name, []).append(value)
            logged_in.setdefault(name, []).append(microbatch)
            options[name] = kwargs
    combined = []
    for name, v in values.items():
        fx = reduce_fx_name(options[name].get("reduce_fx", "mean"))
        if fx == "mean" and all(isinstance(x, int) for x in v):
            fx = "sum"
        once_each = weights is not None and logged_in[name] == list(range(len(weights)))
        combine = _REDUCE.get(fx, lambda x: _weighted_mean(x, weights if once_each else None))
        combined.append((name, float(combine(v)), options[name]))
    return combined


def merge_step_outputs(results: list[Any], weights: list[float] | None = None) -> Any:
    """One output for the whole batch: scalars averaged (weighted as :func:`_combine_logs` weights means),
    batched tensors concatenated, dicts per key."""
    first = results[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            mean = _weighted_mean([float(r.detach().float()) for r in results], weights)
            return torch.tensor(mean, dtype=first.dtype, device=first.device)
        return torch.cat([r.detach() for r in results])
    if isinstance(first, dict):
        return {k: merge_step_outputs([r[k] for r in results], weights) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(merge_step_outputs(list(parts), weights) for parts in zip(*results))
    return results


def apply_logs(module: nn.Module, logged: list[tuple[str, float, dict]], device: torch.device) -> None:
    for name, value, kwargs in logged:
        module.log(name, torch.tensor(value, device=device), **kwargs)
