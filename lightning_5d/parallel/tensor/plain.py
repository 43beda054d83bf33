"""What leaves a step under tensor parallelism: the plain tensors one process would have.

Inside the step the head's logits are a vocabulary-sharded ``DTensor`` (``vocab``), so the
user's ``F.cross_entropy`` runs vocabulary-parallel, and whatever the user derives from them
(``argmax``, accuracy, probabilities) is a DTensor too. Lightning and the user's callbacks
expect plain tensors: ``self.log(..., sync_dist=True)`` all-reduces the value with c10d,
which has no DTensor rule, and a prediction returned as a DTensor is not what one process
returns. At the step's edges (returned outputs, ``self.log`` values, the strategy's
collectives) every DTensor becomes its full tensor: a replicated one (an accuracy from
``argmax``) without communication, a sharded or partial one (``logits.max()``, a sum over
the vocabulary) by a gather or reduction over its tp group, which every tp rank reaches
because they run the same step. ``full_tensor`` is differentiable, so a loss stays one.

A log call meant for one rank (``rank_zero_only=True``) cannot meet its tp peers: a
replicated value is taken as it is, a partial or sharded one is refused with what to do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_5d.parallel.step_log import LogFunction, log_options, log_through, shadowed
from lightning_5d.parallel.tensor.validate import TensorParallelError


def holds_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (a tensor, or dicts, lists, tuples and dataclasses of them) holds a DTensor."""
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, Mapping):
        return any(holds_dtensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_dtensor(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(holds_dtensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def plain_tensors(obj: Any) -> Any:
    """``obj`` with every DTensor in it (nested in dicts, lists, dataclasses) as its full tensor.

    Without a DTensor ``obj`` comes back as it is (a frozen dataclass too, which
    ``apply_to_collection`` cannot rebuild)."""
    if not holds_dtensor(obj):
        return obj
    return apply_to_collection(obj, DTensor, DTensor.full_tensor)


def _on_this_rank_only(name: str, value: Any) -> Any:
    if not isinstance(value, DTensor):
        return value
    if all(isinstance(p, Replicate) for p in value.placements):
        return value.to_local()  # every tp rank holds the whole value: nothing to meet for
    raise TensorParallelError(
        f"self.log({name!r}, ..., rank_zero_only=True) under tp: the value is "
        f"{', '.join(str(p) for p in value.placements)} over the tp "
        f"group (a max, sum or norm over the vocabulary-sharded logits), so its full value needs every tp rank, "
        f"which a rank-0-only call does not reach. Log it on every rank (without rank_zero_only), or log a value "
        f"every tp rank holds whole (a mean of argmax accuracy is)."
    )


def _plain_arguments(call: LogFunction) -> LogFunction:
    def plain_call(*args: Any, **kwargs: Any) -> Any:
        return call(*plain_tensors(args), **plain_tensors(kwargs))

    return plain_call


@contextmanager
def plain_metric_updates(metrics: list[nn.Module]) -> Iterator[None]:
    """A torchmetrics ``Metric.update`` (also through ``metric(preds, target)``) gets plain tensors:
    its ops have no DTensor rule (``MulticlassAccuracy`` of argmax tokens: "aten._unique2.default")."""
    with ExitStack() as stack:
        for metric in metrics:
            stack.enter_context(shadowed(metric, "update", _plain_arguments))
        yield


@contextmanager
def plain_logged_values(module: nn.Module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` values reach Lightning (and an outer region's log) as plain tensors."""

    def make_log(log: LogFunction) -> LogFunction:
        def plain_log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if log_options(args, kwargs).get("rank_zero_only", False):
                return log(name, _on_this_rank_only(name, value), *args, **kwargs)
            return log(name, plain_tensors(value), *args, **kwargs)

        return plain_log

    with log_through(module, make_log):
        yield
