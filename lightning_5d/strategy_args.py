"""``FiveDStrategy``'s constructor arguments, checked and normalised before the strategy holds any
state: the layout (a ``ParallelConfig``) and everything else (``StrategyOptions``). Both classes in
``lightning_5d.config`` declare each field's type and range, and raise ``LayoutError`` naming the
field and its allowed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_5d.config import LayoutError, ParallelConfig, StrategyOptions, ineffective_settings
from lightning_5d.layout_rules import validate_early

SIZES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
# Layout settings whose None means "ParallelConfig's default"; the other settings pass as given.
_NONE_IS_DEFAULT = (*SIZES, "zero", "rank_order", "pipeline", "context", "expert")


@dataclass(frozen=True)
class StrategyArgs:
    config: ParallelConfig
    options: StrategyOptions
    plan_layout: bool  # no size and no ZeRO stage given (as with the string "5d"): the planner decides at setup


def strategy_args(
    config: ParallelConfig | None, layout: Mapping[str, Any], options: Mapping[str, Any]
) -> StrategyArgs:
    """``layout``: the constructor's sizes, ``zero`` and layout settings, ignored when ``config`` is given;
    ``options``: the fields of ``StrategyOptions``. Raises before any process group exists."""
    checked_options = StrategyOptions(**options)
    plan_layout = config is None and not any(layout.get(k) is not None for k in (*SIZES, "zero"))
    config = _parallel_config(config, layout)
    validate_early(config)
    if not plan_layout:  # a planned layout's sizes are not known yet
        _warn_ineffective(config)
    return StrategyArgs(config, checked_options, plan_layout)


def _parallel_config(config: ParallelConfig | None, layout: Mapping[str, Any]) -> ParallelConfig:
    if config is None:
        return ParallelConfig(**{k: v for k, v in layout.items() if v is not None or k not in _NONE_IS_DEFAULT})
    if not isinstance(config, ParallelConfig):
        raise LayoutError(f"config={config!r} is not valid; allowed: a ParallelConfig, or None.")
    return config


def _warn_ineffective(config: ParallelConfig) -> None:
    ineffective = ineffective_settings(config)
    if ineffective:
        sizes = ", ".join(f"{d}={getattr(config, d)}" for d in SIZES)
        rank_zero_warn(
            f"FiveDStrategy: these settings have no effect under the layout {sizes}: " + "; ".join(ineffective),
            category=UserWarning,
        )
