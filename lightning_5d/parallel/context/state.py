"""What the routed pieces of context parallelism share during a step.

Attention (``attention``), positions (``positions``) and the loss (``loss``) each read the
cp group and the current :class:`~lightning_5d.parallel.context.batch.SequenceShard`, and
record what they did (attention calls, ring-attention work, sequence-global values, hooks
to undo). That state lives here, below all of them; :class:`ContextParallel`
(``routing``) adds the per-step driving (begin, step region, end) on top of it.
Symbols: cp ranks, S the global sequence length, S/cp tokens per rank.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_5d.config import ContextConfig
from lightning_5d.forward_patch import replace_forward
from lightning_5d.parallel.context.batch import SequenceShard


class ContextState:
    """The cp group, the step's sequence shard and what the routes record while it is current."""

    def __init__(self, cp_mesh: DeviceMesh, config: ContextConfig) -> None:
        self.group = cp_mesh.get_group()
        self.rank = cp_mesh.get_local_rank()
        self.size = cp_mesh.size()
        self.mode = config.mode
        self.sharding = config.sharding
        self.current: SequenceShard | None = None
        self.attention_calls = 0
        self.stats: dict[str, float] = {}  # ring-attention work (quarter-block units) and receive waits (s)
        self.undo: list[Callable[[], None]] = []  # removes every hook and wrapper the routes install
        self._global: list[Tensor] = []  # this step's sequence-global values (held: ids get reused)
        self._warned_sums: set[str] = set()

    @property
    def current_shard(self) -> SequenceShard:
        if self.current is None:
            raise RuntimeError("no sequence shard is current: context parallelism acts inside a step only.")
        return self.current

    def wrap_forward(self, module: nn.Module, sharded: Callable[..., Any]) -> None:
        """While a shard is current, ``module.forward(*a, **k)`` runs ``sharded(original_forward, *a, **k)``."""
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.current is None:
                return original(*args, **kwargs)
            return sharded(original, *args, **kwargs)

        self.undo.append(replace_forward(module, forward))

    def mark_global(self, value: Tensor) -> Tensor:
        """Record a value that is already the sequence-global one (not to be averaged again)."""
        self._global.append(value)
        return value

    def warn_same_on_every_shard(self, name: str, value: float) -> None:
        """Once per name: a value logged with reduce_fx="sum" was the same on every cp rank."""
        if name in self._warned_sums or self.rank != 0:
            return
        self._warned_sums.add(name)
        warnings.warn(
            f"self.log({name!r}, ..., reduce_fx='sum') under cp={self.size}: the value ({value:g}) is the same on "
            f"every cp rank, and is summed over the {self.size} sequence shards as Lightning sums data ranks under "
            f"sync_dist. That is right for a count of tokens; a count of samples or batches (the same for every shard "
            f"of a sequence) comes out {self.size} times too large: log that as a Python int, which cp leaves as it is."
        )

    def is_global(self, value: Tensor) -> bool:
        return any(value is g for g in self._global)
