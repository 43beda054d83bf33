"""Expert parallelism: each of the ep ranks keeps E/ep experts of every MoE layer.

Public entry: :class:`ExpertParallel` (``moe``): replaces an MoE layer's forward (or its
grouped experts call) with router -> dispatch -> local experts -> combine. Symbols: T tokens
on this rank, k experts per token, E experts, ep ranks (borrowed from dp_shard × cp).

* ``dispatch``: permute the T·k assignments by expert (math), then all-to-all there and back
  (communication), with optional capacity and drops.
* ``balance``: the auxiliary loss E·Σ_e f_e·P_e and the aux-loss-free router bias.
* ``metrics``: tokens per expert, imbalance and drops as a torchmetrics ``Metric``.
"""

from lightning_5d.parallel.expert.moe import ExpertParallel, ExpertParallelError

__all__ = ["ExpertParallel", "ExpertParallelError"]
