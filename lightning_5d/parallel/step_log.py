"""``self.log`` inside a step: a dimension puts its own log in front of the module's for the step.

(The same for another of the module's methods: the pipeline refuses ``self.all_gather`` there.)

Context parallelism weights logged values by tokens, tensor parallelism hands DTensor values
over as the plain tensors one process logs, and the pipeline records them per microbatch for
the last stage to send. Each shadows ``LightningModule.log`` with an instance attribute for
the duration of its region and puts back whatever was there before (another dimension's log,
or nothing), so the regions nest: the innermost region's log meets the user's call first.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator

from lightning.pytorch import LightningModule
from torch import nn

LogFunction = Callable[..., Any]
# LightningModule.log's options after (self, name, value), in their positional order.
_LOG_OPTIONS = tuple(inspect.signature(LightningModule.log).parameters)[3:]


def log_options(args: tuple, kwargs: dict) -> dict:
    """A ``self.log(name, value, ...)`` call's options by name, whether given by position or keyword."""
    return {**dict(zip(_LOG_OPTIONS, args)), **kwargs}


def reduce_fx_name(reduce_fx: Any) -> str:
    """A ``self.log(..., reduce_fx=)`` as Lightning accepts it (a name, ``torch.max``, ``sum``) by its
    name: "mean", "sum", "max" or "min" (Lightning refuses any other when the value is logged).
    Lightning combines a value over data ranks (``sync_dist``) and over steps with it; the
    pipeline combines microbatches and context parallelism sequence shards with it."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    name = name.lower()
    return "mean" if name == "avg" else name


@contextmanager
def shadowed(module: nn.Module, method: str, make: Callable[[LogFunction], LogFunction]) -> Iterator[None]:
    """Inside: ``module.<method>`` is ``make(the method it had)``; afterwards the method it had."""
    own = vars(module).get(method)  # an earlier region's; None: the class's own method
    setattr(module, method, make(getattr(module, method)))
    try:
        yield
    finally:
        if own is None:
            vars(module).pop(method, None)
        else:
            setattr(module, method, own)


def log_through(module: nn.Module, make_log: Callable[[LogFunction], LogFunction]) -> AbstractContextManager:
    """Inside: ``module.log`` is ``make_log(the log it had)``; afterwards the log it had."""
    return shadowed(module, "log", make_log)
