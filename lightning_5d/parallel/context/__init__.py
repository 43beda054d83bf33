"""Context parallelism: the sequence (length S) cut over the cp ranks through the whole model.

Public entry: :class:`ContextParallel` (``routing``): per step it cuts the batch, routes
positions and attention, and makes the loss sequence-global. Modules, in the order a step
meets them:

* ``batch``: zig-zag shards (rank r holds chunks r and 2·cp−1−r of 2·cp) or contiguous.
* ``positions``: each token's global position for the model's position embedding.
* ``attention``: the model's attention calls routed to ``ring`` or ``ulysses``.
* ``ring``: ring / all-gather attention; blocks O_i^(j) with their lse_i^(j) merged by the
  online softmax; ``kernel`` is the fused block kernel, ``reference`` its pure-math oracle.
* ``ulysses``: all-to-all (sequence shard <-> head shard, h/cp heads per rank).
* ``loss``: token-weighted means over the whole sequence, identical on every cp rank.
* ``state``: what those routes share while a step runs.
"""

from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.parallel.context.routing import ContextParallel

__all__ = ["ContextParallel", "ContextParallelError"]
