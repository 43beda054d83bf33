"""Tensor parallelism (+ sequence parallelism): weight matrices split over the tp ranks.

Public entry: :class:`TensorParallel` (``sharding``) turns an unchanged model's projections,
as discovery maps them, into column-/row-parallel linears, Megatron-LM style:

* ``ops``: the conjugate collectives as autograd functions: f (copy in, all-reduce in
  backward) and g (all-reduce out); with SP, f* (all-gather along the sequence) and g*
  (reduce-scatter). Communication only.
* ``sharding``: which rows/columns of each weight a rank keeps (heads h/tp, KV heads,
  fused ``[q|k|v]`` / ``[gate|up]`` layouts); the math of the split.
* ``vocab``: vocabulary-parallel embedding and cross-entropy (rows [r·V/tp, (r+1)·V/tp)).
* ``regather``: under SP, keeps the sequence shard (sbh/tp) of a gathered input for
  backward and gathers it again there.
"""

from lightning_5d.parallel.tensor.sharding import TensorParallel
from lightning_5d.parallel.tensor.validate import TensorParallelError

__all__ = ["TensorParallel", "TensorParallelError"]
