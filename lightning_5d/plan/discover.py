"""``discover``: find where the parts of a transformer are, from four sources in order.

1. EXPLICIT: the user's ``model_plan`` (patterns -> roles), checked strictly;
2. PUBLISHED: the model's own Hugging Face tp/pp/ep plans;
3. REGISTRY: role names of architectures known by class;
4. STRUCTURAL: the module tree itself (layer kinds and common names).

Every part comes from the first source that names it, so a partial explicit plan only
overrides what it names. The plan records the highest-priority source that contributed;
its notes say which parts came from the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, ContextManager

from torch import nn

from lightning_5d.plan import assemble, observe, paths, published, registry, structural
from lightning_5d.plan import explicit as explicit_source
from lightning_5d.plan.adapters import adapter_wrappers
from lightning_5d.plan.adapters import refusal as adapter_refusal
from lightning_5d.plan.attention_probe import ObservedAttention, observe_attention
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.plan.hints import BlockHints, Merged, TopHints, merge
from lightning_5d.plan.model_plan import ModelPlan, PlanSource
from lightning_5d.plan.patterns import (
    Assignment,
    RoleMap,
    Strictness,
    assign,
    block_hints,
    top_hints,
)

SOURCE_ORDER: tuple[PlanSource, ...] = tuple(PlanSource)

# How the notes name the parts a secondary source filled in.
_PART_LABELS = {
    "embedding": "embedding",
    "position_embedding": "position embedding",
    "blocks": "blocks",
    "final_norm": "final norm",
    "head": "head",
    "attention": "attention module",
    "q": "attention projections",
    "k": "attention projections",
    "v": "attention projections",
    "kv": "attention projections",
    "qkv": "attention projections",
    "o": "attention projections",
    "mlp": "MLP",
    "mlp_column": "MLP",
    "mlp_row": "MLP",
    "moe": "MoE",
    "router": "MoE",
    "experts": "MoE",
    "shared_experts": "MoE",
    "shared_expert_gate": "MoE",
    "norms": "norms",
    "num_heads": "head counts",
    "num_kv_heads": "head counts",
    "head_dim": "head counts",
}


@dataclass(frozen=True)
class _PatternSource:
    source: PlanSource
    role_map: RoleMap
    assignments: list[Assignment]
    strictness: Strictness


def discover(
    module: nn.Module,
    explicit: Mapping[str, str] | None = None,
    *,
    sources: Iterable[PlanSource] = SOURCE_ORDER,
    values: Callable[[], ContextManager[Any]] | None = None,
) -> ModelPlan:
    """The :class:`ModelPlan` of ``module`` (usually the LightningModule around the model).

    ``explicit`` maps module-path patterns to roles (see :mod:`lightning_5d.plan.explicit`).
    ``sources`` restricts which sources are consulted (for tests and debugging); the
    order is always the one above. ``values``: for a model built on the meta device, a context
    in which it computes with its recorded initial values (``MetaBuild.values``), so the probe
    forwards observe what they observe on an eager build; without it a meta model is not run
    and what the probes decide is assumed (noted in the plan). Raises ``ModelMappingError``
    naming the missing part, with a ``model_plan`` snippet that would fix it, and
    ``PlanConflictError`` for an explicit plan that contradicts itself or the model.
    """
    wrappers = adapter_wrappers(module)
    if wrappers:  # before any source maps a wrapper, or a model_plan points into one (plan/adapters.py)
        raise ModelMappingError(f"Cannot map {type(module).__name__} for parallelism: {adapter_refusal(wrappers)}.")
    use = frozenset(PlanSource(s) for s in sources)
    pattern_sources = _pattern_sources(module, explicit or {}, use)
    top = _merge_top(module, pattern_sources, use)
    blocks = _merge_blocks(module, top.hints, pattern_sources, use)
    probe = _probe_context(module, values)
    observed: dict[int, ObservedAttention] = {}
    if PlanSource.STRUCTURAL in use and probe is not None:
        with probe():
            observed = _observe_attention(module, top.hints, blocks)
    blocks = [_with_observed(b, observed.get(i)) for i, b in enumerate(blocks)]
    origins = [top.origin] + [b.origin for b in blocks]
    source = _primary_source(origins)
    notes = _notes(origins, source, pattern_sources)
    if observed:
        first = min(observed)
        notes.append(
            f"attention projections of {paths.join(top.hints.blocks, str(first))} (and alike) observed from "
            f"the probe's attention call (q, k, v traced to the linears feeding them)"
        )
    plan = assemble.build(module, top.hints, [b.hints for b in blocks], source, notes)
    return observe.observe(module, _mark_head_bias(plan, observed), probe)


def _probe_context(module: nn.Module, values: Callable[[], ContextManager[Any]] | None):
    """What the probe forwards run in: nothing special for a model with weights, ``values`` for
    one on the meta device (None without it: such a model is not run)."""
    if not any(p.is_meta for p in module.parameters()):
        return nullcontext
    if values is None:
        return None
    context = values()  # one for every probe: a value recomputed for one is kept for the next
    return lambda: context


def _incomplete(hints: BlockHints) -> bool:
    """No projections feeding the attention call that a plan can use: no fused qkv, no q with
    a fused kv, not all three of q, k, v."""
    return not (hints.qkv or (hints.q and hints.kv) or (hints.q and hints.k and hints.v))


def _observe_attention(module: nn.Module, top: TopHints, blocks: Sequence[Merged]) -> dict[int, ObservedAttention]:
    """Watch the attention calls when names left a block's projections incomplete (one probe
    forward for the whole model, in the caller's probe context)."""
    if top.embedding is None or top.blocks is None or not any(_incomplete(b.hints) for b in blocks):
        return {}
    found = observe_attention(module, top.blocks, lambda: observe.run_on_ids(module, top.embedding, top.blocks))
    return {i: o for i, o in found.items() if _incomplete(blocks[i].hints)}


def _with_observed(block: Merged, observed: ObservedAttention | None) -> Merged:
    """The block's parts with the observed attention projections where the others had none.
    The observation replaces a partial attention the names gave (e.g. a q without k and v)."""
    if observed is None:
        return block
    cleared = replace(block.hints, attention=None, q=None, k=None, v=None, kv=None, qkv=None, o=None)
    origin = {k: s for k, s in block.origin.items() if k not in ("attention", "q", "k", "v", "kv", "qkv", "o")}
    merged = merge([(PlanSource.STRUCTURAL, cleared), (PlanSource.STRUCTURAL, observed.hints)])
    # The attention's pre-norm counts among the block's norms even inside the attention module:
    # tensor parallelism must not read it as a norm over a projection's output width.
    norms = tuple(dict.fromkeys([*block.hints.norms, *observed.hints.norms]))
    return Merged(replace(merged.hints, norms=norms), {**merged.origin, **origin})


def _mark_head_bias(plan: ModelPlan, observed: Mapping[int, ObservedAttention]) -> ModelPlan:
    blocks = list(plan.block_plans)
    for i, seen in observed.items():
        if (seen.per_head_bias or seen.linear_bias is not None) and blocks[i].attention is not None:
            attention = replace(blocks[i].attention, per_head_bias=seen.per_head_bias, linear_bias=seen.linear_bias)
            blocks[i] = replace(blocks[i], attention=attention)
    return replace(plan, block_plans=tuple(blocks))


def _pattern_sources(
    module: nn.Module, explicit: Mapping[str, str], use: frozenset[PlanSource]
) -> list[_PatternSource]:
    found: list[_PatternSource] = []
    if PlanSource.EXPLICIT in use and explicit:
        role_map = explicit_source.role_map(explicit)
        assignments = assign(module, role_map.roles, Strictness.STRICT)
        explicit_source.check_heads(module, assignments)
        found.append(_PatternSource(PlanSource.EXPLICIT, role_map, assignments, Strictness.STRICT))
    for source, finder in (
        (PlanSource.PUBLISHED, published.find),
        (PlanSource.REGISTRY, registry.find),
    ):
        if source not in use:
            continue
        role_map = finder(module)
        if role_map:
            assignments = assign(module, role_map.roles, Strictness.LENIENT)
            found.append(_PatternSource(source, role_map, assignments, Strictness.LENIENT))
    return found


def _merge_top(
    module: nn.Module,
    pattern_sources: Sequence[_PatternSource],
    use: frozenset[PlanSource],
) -> Merged:
    candidates: list[tuple[PlanSource, TopHints]] = [
        (p.source, top_hints(p.assignments, p.strictness)) for p in pattern_sources
    ]
    merged = merge(candidates) if candidates else Merged(TopHints(), {})
    if PlanSource.STRUCTURAL in use:
        found = structural.top(module, merged.hints)
        merged = merge([*candidates, (PlanSource.STRUCTURAL, found)])
    return merged


def _merge_blocks(
    module: nn.Module,
    top: TopHints,
    pattern_sources: Sequence[_PatternSource],
    use: frozenset[PlanSource],
) -> list[Merged]:
    if top.blocks is None:
        return []
    count = len(module.get_submodule(top.blocks))
    per_source = [(p, block_hints(p.assignments, top.blocks, p.strictness)) for p in pattern_sources]
    hidden = _hidden_size(module, top)
    merged_blocks = []
    for index in range(count):
        candidates = [
            (p.source, _with_heads(by_index.get(index, BlockHints()), p.role_map)) for p, by_index in per_source
        ]
        merged = merge(candidates) if candidates else Merged(BlockHints(), {})
        if PlanSource.STRUCTURAL in use:
            where = paths.join(top.blocks, str(index))
            found = structural.block(module, where, merged.hints, hidden)
            merged = merge([*candidates, (PlanSource.STRUCTURAL, found)])
        merged_blocks.append(merged)
    return merged_blocks


def _with_heads(hints: BlockHints, role_map: RoleMap) -> BlockHints:
    """Head counts a source declares for the whole model apply to each of its blocks."""
    counts = role_map.heads
    return replace(
        hints,
        num_heads=hints.num_heads or counts.num_heads,
        num_kv_heads=hints.num_kv_heads or counts.num_kv_heads,
        head_dim=hints.head_dim or counts.head_dim,
    )


def _hidden_size(module: nn.Module, top: TopHints) -> int | None:
    embedding = module.get_submodule(top.embedding) if top.embedding else None
    return getattr(embedding, "embedding_dim", None)


def _primary_source(origins: Sequence[dict[str, PlanSource]]) -> PlanSource:
    used = {s for origin in origins for s in origin.values()}
    return next((s for s in SOURCE_ORDER if s in used), PlanSource.STRUCTURAL)


def _notes(
    origins: Sequence[dict[str, PlanSource]],
    primary: PlanSource,
    pattern_sources: Sequence[_PatternSource],
) -> list[str]:
    parts: dict[PlanSource, dict[str, None]] = {}
    for origin in origins:
        for name, source in origin.items():
            if source is not primary:
                parts.setdefault(source, {})[_PART_LABELS[name]] = None
    notes = [n for p in pattern_sources if p.source in parts or p.source is primary for n in p.role_map.notes]
    for source in SOURCE_ORDER:
        if source in parts:
            notes.append(f"from {source.value} source: {', '.join(parts[source])}")
    return notes
