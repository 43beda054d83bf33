"""Partial plans: what one source says about the model, and how sources are combined.

Every source fills what it knows and leaves the rest unset; :func:`merge` takes each
part from the first source (in priority order) that gives it, so a user's explicit
plan can name only the parts discovery gets wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from lightning_5d.plan.model_plan import PlanSource

# Parts that name modules (as opposed to head counts), for the "explicit wins" rule below.
_TOP_PATH_FIELDS = ("embedding", "position_embedding", "blocks", "final_norm", "head")
_BLOCK_PATH_FIELDS = (
    "attention", "q", "k", "v", "kv", "qkv", "o", "mlp", "mlp_column", "mlp_row",
    "moe", "router", "experts", "shared_experts", "shared_expert_gate", "norms",
)  # fmt: skip
_SEPARATE_QKV = ("q", "k", "v", "kv")


@dataclass
class TopHints:
    """Model-level parts, as dotted paths from the discovered module."""

    embedding: str | None = None
    position_embedding: str | None = None
    blocks: str | None = None
    final_norm: str | None = None
    head: str | None = None


@dataclass
class BlockHints:
    """One block's parts, as paths relative to the block; head counts of its attention."""

    attention: str | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    kv: str | None = None  # fused [k|v] beside a separate q
    qkv: str | None = None
    o: str | None = None
    mlp: str | None = None
    mlp_column: tuple[str, ...] = ()
    mlp_row: tuple[str, ...] = ()
    moe: str | None = None
    router: str | None = None
    experts: str | None = None
    shared_experts: str | None = None
    shared_expert_gate: str | None = None
    norms: tuple[str, ...] = ()
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None


def is_given(value: Any) -> bool:
    return value is not None and value != ()


def given_fields(hints: TopHints | BlockHints) -> list[str]:
    return [f.name for f in fields(hints) if is_given(getattr(hints, f.name))]


@dataclass
class Merged:
    """A merged part set and, for each part, the source it came from."""

    hints: Any
    origin: dict[str, PlanSource]


def merge(candidates: Sequence[tuple[PlanSource, TopHints | BlockHints]]) -> Merged:
    """Take every part from the first candidate that gives it (candidates in priority order)."""
    if not candidates:
        raise ValueError("merge() needs at least one candidate")
    kind = type(candidates[0][1])
    values: dict[str, Any] = {}
    origin: dict[str, PlanSource] = {}
    claimed: set[str] = set()
    for source, hints in candidates:
        # A module a higher-priority source already placed keeps that role: a lower
        # source may not put it in a second one.
        taken_here: set[str] = set()
        for name in given_fields(hints):
            if name in values:
                continue
            value = _unclaimed(getattr(hints, name), claimed)
            if not is_given(value):
                continue
            values[name] = value
            origin[name] = source
            taken_here.update(_paths_of(name, value))
        claimed |= taken_here
    merged = kind(**values)
    if isinstance(merged, BlockHints):
        merged = _one_qkv_layout(merged, origin)
    return Merged(merged, origin)


def _paths_of(name: str, value: Any) -> set[str]:
    if name not in _TOP_PATH_FIELDS + _BLOCK_PATH_FIELDS:
        return set()
    if isinstance(value, tuple):
        return set(value)
    # Containers (attention, mlp, moe) may hold modules other sources name; only leaf
    # modules are exclusive.
    if name in ("attention", "mlp", "moe", "blocks"):
        return set()
    return {value}


def _unclaimed(value: Any, claimed: set[str]) -> Any:
    if isinstance(value, tuple):
        return tuple(v for v in value if v not in claimed)
    if isinstance(value, str) and value in claimed:
        return None
    return value


def _one_qkv_layout(hints: BlockHints, origin: dict[str, PlanSource]) -> BlockHints:
    """Fused and separate q/k/v from different sources: keep the higher-priority one."""
    separate = [origin[n] for n in _SEPARATE_QKV if n in origin]
    if hints.qkv is None or not separate:
        return hints
    order = list(PlanSource)
    if order.index(origin["qkv"]) <= min(order.index(s) for s in separate):
        for name in _SEPARATE_QKV:
            origin.pop(name, None)
        return replace(hints, q=None, k=None, v=None, kv=None)
    origin.pop("qkv")
    return replace(hints, qkv=None)
