"""What the checkpoint writer and reader both see of the strategy's state: the splits that cut
this model, and optimizer state handled one statistic at a time."""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor
from torch.distributed.tensor import DTensor


def split_dims(strategy: Any) -> list:
    """tp, ep and pp as they split this model (each has full_state / local_state)."""
    return [x for x in (strategy._tp, strategy._ep, strategy._pp) if x is not None]


def per_stat(
    state: dict[str, dict[str, Any]], convert: Callable[[dict[str, Any]], dict[str, Any]], all_stats: bool = False
) -> dict:
    """Apply a name-keyed model-state conversion (an ep split) to each optimizer statistic
    (scalars such as Adam's step only with ``all_stats``: they are not split)."""

    def takes(v: Any) -> bool:
        return isinstance(v, Tensor) and (all_stats or v.dim() > 0)

    out: dict[str, dict[str, Any]] = {n: dict(s) for n, s in state.items()}
    stats = sorted({k for s in state.values() for k, v in s.items() if takes(v)})
    for stat in stats:  # the same order on every rank: the conversions may be collectives
        converted = convert({n: s[stat] for n, s in state.items() if takes(s.get(stat))})
        for name, value in converted.items():
            out.setdefault(name, {})[stat] = value
    return out


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
