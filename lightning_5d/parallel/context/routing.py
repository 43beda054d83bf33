"""Context parallelism of an unchanged model: the sequence cut over the cp ranks end to end.

What each step does (the strategy calls :meth:`ContextParallel.begin` with the step's
batch, runs the user's step inside :meth:`ContextParallel.step_region`, and calls
:meth:`ContextParallel.end` once backward is done):

1. **Batch** (``batch``): every ``[b, S, ...]`` tensor is cut along the sequence,
   zig-zag by default (rank r holds chunks r and 2·cp−1−r of 2·cp) so causal attention
   costs every rank the same.
2. **Positions** (``positions``): the model's position embedding sees each
   token's global position.
3. **Attention** (``attention``): each block's attention runs
   :func:`~lightning_5d.parallel.context.ring.ring_attention` over the cp group.
4. **Loss and metrics**: the step's cross-entropy is the token mean over the whole
   sequence (``parallel/token_mean.py``, with the data ranks' and microbatches' tokens), and
   logged values are token-weighted over the shards (``loss``); both identical on every cp rank.

Everything else in the model works per token and needs nothing. The cp ranks hold the
same weights; gradients are averaged over dp×cp by the data-parallel engine (the mesh's
``dp_cp`` / ``dp_shard_cp``), exactly like more data ranks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lightning_5d.config import ContextConfig, ContextParallelMode
from lightning_5d.parallel.context import attention as context_attention
from lightning_5d.parallel.context.attention import HuggingFaceSwitch, hugging_face_models, route_attention
from lightning_5d.parallel.context.batch import ContextParallelError, shard_batch
from lightning_5d.parallel.context.hybrid import check_hybrid
from lightning_5d.parallel.context.loss import global_metric
from lightning_5d.parallel.context.positions import route_positions
from lightning_5d.parallel.context.state import ContextState
from lightning_5d.parallel.step_log import log_options, log_through
from lightning_5d.plan.model_plan import ModelPlan

__all__ = ["ContextParallel", "ContextParallelError"]


class ContextParallel(ContextState):
    """Routes ``module``'s positions and attention for sequence shards over ``cp_mesh``.

    ``hybrid_groups(ulysses)``: this rank's (Ulysses, ring) process groups of the hybrid mode
    (:meth:`lightning_5d.mesh.ParallelMesh.context_groups`), created only after the model's
    heads per tensor-parallel rank (``tp``) passed :func:`check_hybrid`.
    """

    def __init__(
        self, module: nn.Module, plan: ModelPlan, cp_mesh: DeviceMesh, config: ContextConfig,
        hybrid_groups: Callable[[int], tuple[Any, Any]] | None = None, tp: int = 1,
    ) -> None:  # fmt: skip
        super().__init__(cp_mesh, config)
        self.ulysses = config.ulysses
        self.ulysses_group: Any = None
        self.ring_group: Any = None
        if self.mode is ContextParallelMode.HYBRID:
            for _, att in plan.attentions:
                check_hybrid(self.size, self.ulysses, (att.num_heads // tp, (att.num_kv_heads or att.num_heads) // tp))
            if hybrid_groups is None:
                raise ContextParallelError("context.mode='hybrid' needs the mesh's Ulysses and ring groups.")
            self.ulysses_group, self.ring_group = hybrid_groups(self.ulysses)
        self._checked_peers = False
        previous = getattr(module, _ATTACHED, None)
        if previous is not None:  # a new Trainer on the same module: one set of hooks, not two
            previous.remove()
        hf_models = hugging_face_models(module)
        self.attention_route = route_attention(self, module, plan, hf_models)
        self.position_route = route_positions(
            self, module, plan, [(f"{n}.base_model", m.base_model) for n, m in hf_models]
        )
        self._hf = HuggingFaceSwitch(hf_models)
        object.__setattr__(module, _ATTACHED, self)
        self._module = module

    def describe(self) -> str:
        mode = self.mode.value
        if self.ulysses_group is not None:
            mode += f" ulysses={self.ulysses} x ring={self.size // self.ulysses}"
        return (
            f"cp={self.size} ({mode}, {self.sharding.value}); attention: {self.attention_route}; "
            f"positions: {self.position_route}"
        )

    def remove(self) -> None:
        self.end()
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
        if getattr(self._module, _ATTACHED, None) is self:
            object.__delattr__(self._module, _ATTACHED)

    # ------------------------------------------------------------------ per step
    def begin(self, batch: Any) -> Any:
        """Cut the step's batch; routing stays on until :meth:`end` (backward recomputation included)."""
        shard = shard_batch(batch, self.rank, self.size, self.sharding)
        self.current = shard
        if not self._checked_peers:
            self._check_peers_read_the_same_batch(batch, shard.seq_len)
        if self not in context_attention._ACTIVE:
            context_attention._ACTIVE.append(self)
        self._hf.on()
        self.attention_calls = 0
        self._global.clear()
        return shard.batch

    def end(self) -> None:
        self.current = None
        self._global.clear()
        self._hf.off()
        if self in context_attention._ACTIVE:
            context_attention._ACTIVE.remove(self)

    def _check_peers_read_the_same_batch(self, batch: Any, seq_len: int) -> None:
        """Once: cp peers must cut the same sequences (per-rank augmentation or worker seeds would not)."""
        self._checked_peers = True
        digest = torch.tensor(seq_len, dtype=torch.int64)
        for t in _tensors(batch):
            if not t.is_floating_point():
                digest = digest + t.sum().to(torch.int64).cpu()
        extremes = torch.stack([digest, -digest]).to(self.current_shard.positions.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        if int(extremes[0]) != -int(extremes[1]):  # max != min: some peer read something else
            raise ContextParallelError(
                f"the cp={self.size} ranks of one data rank read different batches (sequence length or content); "
                f"cp peers must load the same samples. Seed data workers and random augmentation by the data "
                f"rank (trainer.strategy.mesh.data_rank), not the global rank."
            )

    @contextmanager
    def step_region(self, module: nn.Module) -> Iterator[None]:
        """Where the user's step runs: ``self.log`` values combined over the shards (the cross-entropy over
        the sequence: parallel/token_mean.py)."""

        def make_log(original: Callable[..., Any]) -> Callable[..., Any]:
            def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
                options = log_options(args, kwargs)
                if not options.get("rank_zero_only", False):  # a rank-0-only call has no peers to meet
                    value = global_metric(self, value, options.get("reduce_fx", "mean"), name)
                return original(name, value, *args, **kwargs)

            return log

        with log_through(module, make_log), _GlobalLoss(self):
            yield
        if self.attention_calls == 0:
            raise ContextParallelError(
                f"no attention call went through ring attention during this step under cp={self.size}: the "
                f"model's attention ran on its shard alone, which is wrong. Route it through "
                f"F.scaled_dot_product_attention in the attention modules discovery maps, or use cp=1."
            )


_ATTACHED = "_lightning_5d_context_parallel"


def _tensors(batch: Any) -> list[Tensor]:
    out: list[Tensor] = []
    apply_to_collection(batch, Tensor, out.append)
    return out


class _GlobalLoss(TorchFunctionMode):
    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # Routed attention modules intercept their SDPA call before it gets here.
            raise ContextParallelError(
                f"an F.scaled_dot_product_attention call outside the attention modules discovery mapped ran on this "
                f"rank's shard alone under cp={self.cp.size} (a second model, or attention outside the blocks); "
                f"map it with model_plan, or use cp=1."
            )
        return func(*args, **kwargs)
