"""Context parallelism of an unchanged model: the sequence cut over the cp ranks end to end.

What each step does (the strategy calls :meth:`ContextParallel.begin` with the step's
batch, runs the user's step inside :meth:`ContextParallel.step_region`, and calls
:meth:`ContextParallel.end` once backward is done):

1. **Batch** (``context_batch``): every ``[b, S, ...]`` tensor is cut along the sequence,
   zig-zag by default (rank r holds chunks r and 2·cp−1−r of 2·cp) so causal attention
   costs every rank the same.
2. **Positions** (``context_positions``): the model's position embedding sees each
   token's global position.
3. **Attention** (``context_attention``): each block's attention runs
   :func:`~lightning_5d.parallel.ring_attention.ring_attention` over the cp group.
4. **Loss and metrics** (``context_loss``): token-weighted means over the whole sequence,
   identical on every cp rank.

Everything else in the model works per token and needs nothing. The cp ranks hold the
same weights; gradients are averaged over dp×cp by the data-parallel engine (the mesh's
``dp_cp`` / ``dp_shard_cp``), exactly like more data ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lightning_5d.config import ContextConfig
from lightning_5d.parallel import context_attention
from lightning_5d.parallel.context_attention import route_attention
from lightning_5d.parallel.context_batch import ContextParallelError, SequenceShard, shard_batch
from lightning_5d.parallel.context_loss import global_cross_entropy, global_metric
from lightning_5d.parallel.context_positions import route_positions
from lightning_5d.plan.model_plan import ModelPlan

__all__ = ["ContextParallel", "ContextParallelError"]


class ContextParallel:
    """Routes ``module``'s positions and attention for sequence shards over ``cp_mesh``."""

    def __init__(self, module: nn.Module, plan: ModelPlan, cp_mesh: DeviceMesh, config: ContextConfig) -> None:
        self.group = cp_mesh.get_group()
        self.rank = cp_mesh.get_local_rank()
        self.size = cp_mesh.size()
        self.mode = config.mode
        self.sharding = config.sharding
        self.current: SequenceShard | None = None
        self.attention_calls = 0
        self.stats: dict[str, int] = {}  # ring-attention work, in quarter-block units
        self._global_ids: set[int] = set()
        self.attention_route = route_attention(self, module, plan)
        self.position_route = route_positions(self, module, plan)

    def describe(self) -> str:
        return (
            f"cp={self.size} ({self.mode.value}, {self.sharding.value}); attention: {self.attention_route}; "
            f"positions: {self.position_route}"
        )

    @property
    def current_shard(self) -> SequenceShard:
        if self.current is None:
            raise RuntimeError("no sequence shard is current: context parallelism acts inside a step only.")
        return self.current

    # ------------------------------------------------------------------ per step
    def begin(self, batch: Any) -> Any:
        """Cut the step's batch; routing stays on until :meth:`end` (backward recomputation included)."""
        if self not in context_attention._ACTIVE:
            context_attention._ACTIVE.append(self)
        self.current = shard_batch(batch, self.rank, self.size, self.sharding)
        self.attention_calls = 0
        self._global_ids.clear()
        return self.current.batch

    def end(self) -> None:
        self.current = None
        if self in context_attention._ACTIVE:
            context_attention._ACTIVE.remove(self)

    @contextmanager
    def step_region(self, module: nn.Module) -> Iterator[None]:
        """Where the user's step runs: global cross-entropy and token-weighted ``self.log``."""
        had_own_log = "log" in vars(module)
        original = module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            return original(name, global_metric(self, value), *args, **kwargs)

        module.log = log
        try:
            with _GlobalLoss(self):
                yield
        finally:
            if had_own_log:
                module.log = original
            else:
                del module.log
        if self.attention_calls == 0:
            raise ContextParallelError(
                f"no attention call went through ring attention during this step under cp={self.size}: the "
                f"model's attention ran on its shard alone, which is wrong. Route it through "
                f"F.scaled_dot_product_attention (or Hugging Face attn_implementation='sdpa'), or use cp=1."
            )

    def mark_global(self, value: Tensor) -> Tensor:
        self._global_ids.add(id(value))
        return value

    def is_global(self, value: Tensor) -> bool:
        return id(value) in self._global_ids


class _GlobalLoss(TorchFunctionMode):
    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            return global_cross_entropy(self.cp, func, args, kwargs)
        return func(*args, **kwargs)
