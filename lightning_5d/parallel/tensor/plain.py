"""What leaves a step under tensor parallelism: the plain tensors one process would have.

Inside the step the head's logits are a vocabulary-sharded ``DTensor`` (``vocab``), so the
user's ``F.cross_entropy`` runs vocabulary-parallel, and whatever the user derives from them
(``argmax``, accuracy, probabilities) is a DTensor too. Lightning and the user's callbacks
expect plain tensors: ``self.log(..., sync_dist=True)`` all-reduces the value with c10d,
which has no DTensor rule, and a prediction returned as a DTensor is not what one process
returns. At the step's edges (returned outputs, ``self.log`` values, the strategy's
collectives) every DTensor becomes its full tensor: a replicated one without communication,
a sharded or partial one by a gather or sum over its tp group, which every tp rank reaches
because they run the same step. ``full_tensor`` is differentiable, so a loss stays one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_5d.parallel.step_log import LogFunction, log_through


def plain_tensors(obj: Any) -> Any:
    """``obj`` with every DTensor in it (nested in dicts, lists, dataclasses) as its full tensor."""
    return apply_to_collection(obj, DTensor, DTensor.full_tensor)


@contextmanager
def plain_logged_values(module: nn.Module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` values reach Lightning (and an outer region's log) as plain tensors."""

    def make_log(log: LogFunction) -> LogFunction:
        def plain_log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            return log(name, plain_tensors(value), *args, **kwargs)

        return plain_log

    with log_through(module, make_log):
        yield
