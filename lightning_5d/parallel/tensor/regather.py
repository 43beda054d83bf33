"""Keep only the sequence shard of an all-gathered activation for backward.

Under sequence parallelism each TP region starts with f*: the rank's ``[b, s/t, h]`` shard
is all-gathered to ``[b, s, h]`` and fed to the column-parallel linears, which save their
input for the weight gradient. Saved as is, that is ``(1 - 1/t)·sbh`` more per region than
Korthikanti et al. count. Megatron-LM saves the shard and all-gathers again in backward;
here the same happens through saved-tensor hooks around the region: a saved tensor that
lives in the gathered storage is packed as the shard, and the first unpack in backward
gathers it again (once for all the linears of the region: q, k and v share it).

Backward unpacks in the same order on every rank (the graphs are identical), so the
re-gathers pair up across the TP group. Skipped when another saved-tensor hook is active
(activation checkpointing, CPU offloading): that one already decides what is kept. Hooks
that only observe (``observes_only = True`` on their pack function, as the activation
meter of ``accounting``) are chained instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_5d.parallel.tensor.ops import all_gather_sequence


@dataclass
class _Gathered:
    shard: Tensor
    seq_dim: int
    group: dist.ProcessGroup
    refs: int = 0
    full: Tensor | None = field(default=None, repr=False)

    def get(self) -> Tensor:
        if self.full is None:
            self.full = all_gather_sequence(self.shard, self.seq_dim, self.group)
        return self.full

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            self.full = None  # every user unpacked it: free the gathered copy


@dataclass(frozen=True)
class _Packed:
    source: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class RegatherRegion:
    """Saved-tensor hooks for one forward of a TP region; ``enter`` after f*, ``exit`` after it."""

    def __init__(self) -> None:
        self._stack: list[Any] = []

    def enter(self, gathered: Tensor, shard: Tensor, seq_dim: int, group: dist.ProcessGroup) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not torch.is_grad_enabled() or (outer is not None and not getattr(outer[0], "observes_only", False)):
            self._stack.append(None)
            return
        # An observing hook (a meter) keeps seeing what is really stored: the shard.
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        source = _Gathered(shard.detach(), seq_dim, group)
        ptr = gathered.untyped_storage().data_ptr()

        def pack(t: Tensor) -> Any:
            if t.untyped_storage().data_ptr() != ptr:
                return outer_pack(t) if outer_pack is not None else t
            if source.refs == 0 and outer_pack is not None:
                outer_pack(source.shard)
            source.refs += 1
            return _Packed(source, tuple(t.shape), tuple(t.stride()), t.storage_offset())

        def unpack(p: Any) -> Tensor:
            if not isinstance(p, _Packed):
                return outer_unpack(p) if outer_unpack is not None else p
            full = p.source.get()
            out = full.as_strided(p.size, p.stride, p.offset)
            p.source.release()
            return out

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._stack.append(hooks)

    def exit(self) -> None:
        if not self._stack:  # the region's f* raised before entering: nothing to leave
            return
        hooks = self._stack.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
