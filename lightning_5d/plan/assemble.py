"""Turn merged hints into a checked :class:`ModelPlan`.

Everything that follows from the modules themselves is computed here, whatever source
named them: layer kinds, fused segment sizes, head_dim, the head attributes, the
attention kernel, vocabulary and hidden sizes. Missing or inconsistent parts raise a
:class:`ModelMappingError` that names the part and shows the config that would fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

from torch import nn

from lightning_5d.plan import heads, kernel, kinds, moe_parts, paths
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.plan.hints import BlockHints, TopHints
from lightning_5d.plan.model_plan import (
    AttentionPlan,
    BlockPlan,
    ColumnLayout,
    MLPPlan,
    ModelPlan,
    MoEPlan,
    PlanSource,
    Projection,
)
from lightning_5d.plan.snippet import model_plan_snippet


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    segments: tuple[int, ...] = ()  # for a fused qkv
    note: str = ""

    @property
    def kv_segments(self) -> tuple[int, ...]:
        """A fused [k|v] beside q: two segments of KV*d (empty without head counts)."""
        width = self.num_kv_heads * self.head_dim
        return (width, width) if width else ()


class _Unmappable(Exception):
    """A part is missing or wrong; turned into a ModelMappingError with the snippet."""


def build(
    root: nn.Module,
    top: TopHints,
    blocks: Sequence[BlockHints],
    source: PlanSource,
    notes: Sequence[str],
) -> ModelPlan:
    missing = _missing_top(root, top)
    if missing:
        _fail(root, top, blocks[0] if blocks else None, "; ".join(missing))
    embedding = root.get_submodule(top.embedding)
    all_notes = list(notes)
    block_plans = []
    for index, hints in enumerate(blocks):
        try:
            block_plans.append(_block_plan(root, top, index, hints, all_notes))
        except _Unmappable as problem:
            _fail(root, top, hints, str(problem))
    if block_plans and all(b.attention is None for b in block_plans):
        _fail(root, top, blocks[0], f"no attention projections found in any block of {top.blocks}")
    bare = [str(i) for i, b in enumerate(block_plans) if b.mlp is None and b.moe is None]
    if bare:
        all_notes.append(f"no MLP or MoE found in block(s) {', '.join(bare)}")
    head = root.get_submodule(top.head) if top.head else None
    if head is not None and kinds.out_features(head) != embedding.num_embeddings:
        all_notes.append(
            f"head {top.head} has {kinds.out_features(head)} outputs, the vocabulary {embedding.num_embeddings}"
        )
    return ModelPlan(
        source=source,
        embedding=top.embedding,
        blocks=top.blocks,
        block_plans=tuple(block_plans),
        vocab_size=embedding.num_embeddings,
        hidden_size=embedding.embedding_dim,
        final_norm=top.final_norm,
        head=top.head,
        position_embedding=top.position_embedding,
        tied_head=head is not None and head.weight is embedding.weight,
        notes=tuple(dict.fromkeys(all_notes)),
    )


def _missing_top(root: nn.Module, top: TopHints) -> list[str]:
    missing = []
    if top.embedding is None:
        missing.append(f"no token embedding found in {type(root).__name__} (an nn.Embedding outside the blocks)")
    if top.blocks is None:
        missing.append(
            f"no transformer blocks found in {type(root).__name__} (an nn.ModuleList, or an "
            f"nn.ModuleDict keyed '0', '1', ..., of identical blocks); its children: {_children(root)}"
        )
    return missing


def _fail(root: nn.Module, top: TopHints, block: BlockHints | None, problem: str) -> NoReturn:
    raise ModelMappingError(
        f"Cannot map {_model_named(root, top)} for parallelism: {problem}.\n"
        f"Name the parts in the strategy config, for example:\n\n"
        f"{model_plan_snippet(top, block)}"
    )


def _model_named(root: nn.Module, top: TopHints) -> str:
    """The module holding the blocks (the user's model), not the wrapper discovery started from."""
    if not top.blocks or "." not in top.blocks:
        return type(root).__name__
    owner = paths.parent(top.blocks)
    return f"{type(root.get_submodule(owner)).__name__} ({owner}, holding {top.blocks})"


def _children(module: nn.Module) -> str:
    named = [f"{name} ({type(child).__name__})" for name, child in module.named_children()]
    return ", ".join(named) or "none"


# ---------------------------------------------------------------- one block


def _block_plan(root: nn.Module, top: TopHints, index: int, hints: BlockHints, notes: list[str]) -> BlockPlan:
    where = paths.join(top.blocks, str(index))
    block = root.get_submodule(where)
    moe = _moe_plan(root, block, where, hints, notes)
    mlp = _outside_moe(_mlp_plan(block, where, hints), moe, notes)
    if _no_attention(hints) and (mlp is not None or moe is not None):
        # One entry of a list that alternates attention and MLP entries: its MLP half.
        notes.append(f"block {where} has no attention (a feed-forward entry of the block list)")
        attention = None
    else:
        attention = _attention_plan(block, where, hints, notes)
    return BlockPlan(
        attention=attention,
        mlp=mlp,
        moe=moe,
        norms=hints.norms,
    )


def _no_attention(hints: BlockHints) -> bool:
    # Projections only: a model_plan pattern like "layers.*.fn.fn": attention(heads=4) also names
    # the MLP entries' module at that path, which holds no attention projection.
    return not any((hints.q, hints.k, hints.v, hints.qkv, hints.o))


def _projection(block: nn.Module, path: str, segments: tuple[int, ...] = ()) -> Projection:
    layout = ColumnLayout.SEGMENTS if segments else ColumnLayout.PLAIN
    return Projection(path, kinds.projection_kind(block.get_submodule(path)), segments, layout)


def _attention_plan(block: nn.Module, where: str, hints: BlockHints, notes: list[str]) -> AttentionPlan:
    if hints.kv and not hints.qkv:
        # q on its own, k and v from one fused [k|v]: the same as separate q, k, v for every
        # check below but the widths, which _head_layout reads from the fused projection.
        if not hints.q:
            raise _Unmappable(
                f"the attention of block {where} has a fused kv={hints.kv} but no q projection "
                f"(children of {paths.join(where, paths.parent(hints.kv))}: "
                f"{_children(block.get_submodule(paths.parent(hints.kv)))})"
            )
        hints = replace(hints, k=None, v=None)
        separate = {"q": hints.q, "kv": hints.kv}
    else:
        separate = {n: getattr(hints, n) for n in ("q", "k", "v")}
    if not hints.qkv and any(separate.values()) and not all(separate.values()):
        have = ", ".join(f"{n}={p}" for n, p in separate.items() if p)
        lack = ", ".join(n for n, p in separate.items() if not p)
        inside = paths.common_parent([p for p in separate.values() if p])
        raise _Unmappable(
            f"the attention of block {where} has {have} but no {lack} projection "
            f"(children of {paths.join(where, inside)}: "
            f"{_children(block.get_submodule(inside))})"
        )
    if not (all(separate.values()) or hints.qkv):
        raise _Unmappable(f"no attention projections found in block {where} (children: {_children(block)})")
    column = [hints.qkv] if hints.qkv else [p for p in separate.values() if p]
    attention_path = hints.attention if hints.attention is not None else paths.common_parent(column)
    if hints.o is None:
        raise _Unmappable(
            f"attention {paths.join(where, attention_path)} has no output projection "
            f"(children: {_children(block.get_submodule(attention_path))})"
        )
    if hints.num_heads is None:
        # Only tensor parallelism cuts by heads (it refuses a plan without them); cp, pp,
        # FP8 and ZeRO never read a head count, so its absence is a note, not an error.
        layout = HeadLayout(0, 0, 0)
        notes.append(
            f"no head count for attention {attention_path} (the module and its configs declare none); "
            f"tensor parallelism needs one: attention(heads=...)"
        )
    else:
        layout = _head_layout(block, where, hints)
        _check_output_width(block, where, hints.o, layout)
    if layout.note:
        notes.append(f"attention {attention_path}: {layout.note}")
    attention = block.get_submodule(attention_path)
    return AttentionPlan(
        path=attention_path,
        o=_projection(block, hints.o),
        q=_projection(block, hints.q) if not hints.qkv else None,
        k=_projection(block, hints.k) if hints.k and not hints.qkv else None,
        v=_projection(block, hints.v) if hints.v and not hints.qkv else None,
        kv=_projection(block, hints.kv, layout.kv_segments) if hints.kv and not hints.qkv else None,
        qkv=_projection(block, hints.qkv, layout.segments) if hints.qkv else None,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        head_attributes=heads.head_attributes(attention, layout.num_heads, layout.num_kv_heads, layout.head_dim),
        kernel=kernel.detect(attention),
    )


def _width(block: nn.Module, path: str) -> int:
    return kinds.out_features(block.get_submodule(path))


def _head_layout(block: nn.Module, where: str, hints: BlockHints) -> HeadLayout:
    if hints.qkv:
        return _fused_layout(_width(block, hints.qkv), where, hints)
    if hints.kv:
        kv_width = _width(block, hints.kv)
        if kv_width % 2:
            raise _Unmappable(f"in block {where}, fused kv {hints.kv} has an odd number ({kv_width}) of output features")
        return _separate_layout(
            (_width(block, hints.q), kv_width // 2, kv_width // 2), where, replace(hints, k=hints.kv, v=hints.kv)
        )
    return _separate_layout(
        (_width(block, hints.q), _width(block, hints.k), _width(block, hints.v)),
        where,
        hints,
    )


def _divide(width: int, by: int, path: str, what: str, where: str) -> int:
    if by <= 0 or width % by:
        raise _Unmappable(
            f"in block {where}, {path} has {width} output features, which do not split "
            f"into {what}; give the right head counts as attention(heads=..., kv_heads=...)"
        )
    return width // by


def _separate_layout(widths: tuple[int, int, int], where: str, hints: BlockHints) -> HeadLayout:
    q_width, k_width, _ = widths
    h = hints.num_heads
    d = hints.head_dim or _divide(q_width, h, hints.q, f"{h} heads", where)
    kv = hints.num_kv_heads or _divide(k_width, d, hints.k, f"heads of head_dim {d}", where)
    expected = {hints.q: h * d, hints.k: kv * d, hints.v: kv * d}
    for (path, want), got in zip(expected.items(), widths):
        if want != got:
            raise _Unmappable(
                f"in block {where}, {path} has {got} output features but {h} heads, {kv} kv "
                f"heads and head_dim {d} need {want}; give the right head counts as "
                f"attention(heads=..., kv_heads=...)"
            )
    _check_groups(h, kv, where)
    return HeadLayout(h, kv, d)


def _fused_layout(width: int, where: str, hints: BlockHints) -> HeadLayout:
    h, kv, d = hints.num_heads, hints.num_kv_heads, hints.head_dim
    note = ""
    if kv is None:
        if d is None:
            kv, note = h, "no kv head count declared; assumed equal to the head count"
        else:
            kv = (_divide(width, d, hints.qkv, f"heads of head_dim {d}", where) - h) // 2
    if d is None:
        d = _divide(width, h + 2 * kv, hints.qkv, f"{h} + 2x{kv} heads", where)
    segments = (h * d, kv * d, kv * d)
    if sum(segments) != width or kv <= 0:
        raise _Unmappable(
            f"in block {where}, fused {hints.qkv} has {width} output features but {h} heads, "
            f"{kv} kv heads and head_dim {d} make {sum(segments)}; give the right head counts "
            f"as attention(heads=..., kv_heads=...)"
        )
    _check_groups(h, kv, where)
    return HeadLayout(h, kv, d, segments, note)


def _check_groups(heads_: int, kv: int, where: str) -> None:
    if heads_ % kv:
        raise _Unmappable(
            f"in block {where}, {kv} kv heads do not divide {heads_} query heads; each kv "
            f"head must serve a whole group of query heads"
        )


def _check_output_width(block: nn.Module, where: str, o: str, layout: HeadLayout) -> None:
    got = kinds.in_features(block.get_submodule(o))
    if got != layout.num_heads * layout.head_dim:
        raise _Unmappable(
            f"in block {where}, output projection {o} takes {got} features but "
            f"{layout.num_heads} heads x head_dim {layout.head_dim} give "
            f"{layout.num_heads * layout.head_dim}; give the right head counts as "
            f"attention(heads=..., kv_heads=...)"
        )


def _mlp_plan(block: nn.Module, where: str, hints: BlockHints) -> MLPPlan | None:
    if not hints.mlp_column and not hints.mlp_row:
        return None
    if not (hints.mlp_column and hints.mlp_row):
        have, lack = ("column", "row") if hints.mlp_column else ("row", "column")
        raise _Unmappable(
            f"the MLP of block {where} has {have} projections "
            f"({', '.join(hints.mlp_column or hints.mlp_row)}) but no {lack} projection"
        )
    layers = hints.mlp_column + hints.mlp_row
    return MLPPlan(
        path=hints.mlp if hints.mlp is not None else paths.common_parent(layers),
        column=tuple(_projection(block, p, _gate_up_segments(block, p, hints)) for p in hints.mlp_column),
        row=tuple(_projection(block, p) for p in hints.mlp_row),
    )


def _gate_up_segments(block: nn.Module, column: str, hints: BlockHints) -> tuple[int, ...]:
    """``(I, I)`` for the one column projection of an MLP that is twice as wide as its row
    projections take: a fused ``[gate | up]`` (``gate, up = proj(x).chunk(2, -1)``, the common
    order; the probe in :mod:`lightning_5d.plan.observe` checks it when it can run the model)."""
    if len(hints.mlp_column) != 1:
        return ()
    width = sum(kinds.in_features(block.get_submodule(r)) for r in hints.mlp_row)
    if _width(block, column) == 2 * width:
        return (width, width)
    return ()


def _moe_plan(root: nn.Module, block: nn.Module, where: str, hints: BlockHints, notes: list[str]) -> MoEPlan | None:
    if not (hints.router or hints.experts):
        return None
    if not (hints.router and hints.experts):
        have = f"experts {hints.experts}" if hints.experts else f"router {hints.router}"
        notes.append(f"block {where}: {have} without its counterpart; MoE left out of the plan")
        return None
    experts = block.get_submodule(hints.experts)
    router = block.get_submodule(hints.router)
    kind = moe_parts.experts_kind(experts)
    if kind is None:
        raise _Unmappable(
            f"in block {where}, experts {hints.experts} ({kinds.describe_kind(experts)}) is neither an "
            f"nn.ModuleList of experts nor a module holding [num_experts, ...] weights"
        )
    scored = moe_parts.router_rows(router)
    if scored is None:
        raise _Unmappable(
            f"in block {where}, router {hints.router} ({kinds.describe_kind(router)}) is neither a linear "
            f"layer nor a module with a 2-D weight [num_experts, hidden]"
        )
    count = moe_parts.expert_count(experts)
    if scored != count:
        raise _Unmappable(
            f"in block {where}, router {hints.router} scores {scored} experts but {hints.experts} holds {count}"
        )
    path = hints.moe if hints.moe is not None else paths.common_parent([hints.router, hints.experts])
    return MoEPlan(
        path=path,
        router=hints.router,
        experts=hints.experts,
        num_experts=count,
        shared_experts=hints.shared_experts,
        experts_kind=kind,
        top_k=moe_parts.top_k(block.get_submodule(path), router, _config_near(root, where)),
        shared_expert_gate=hints.shared_expert_gate,
    )


def _config_near(root: nn.Module, where: str) -> object | None:
    """The ``config`` of the nearest module on the path from ``where`` up to the root."""
    chain = [where]
    while chain[-1]:
        chain.append(paths.parent(chain[-1]))
    for ancestor in chain:
        config = heads.config_of(root.get_submodule(ancestor))
        if config is not None:
            return config
    return None


def _outside_moe(mlp: MLPPlan | None, moe: MoEPlan | None, notes: list[str]) -> MLPPlan | None:
    """A dense MLP found inside the block's MoE is the MoE's (its shared expert), not the block's."""
    if mlp is None or moe is None:
        return mlp
    layers = [p.path for p in mlp.column + mlp.row]
    containers = [c for c in (moe.shared_experts, moe.path) if c]
    if not any(all(paths.is_within(p, c) for p in layers) for c in containers):
        return mlp
    notes.append(f"MLP {mlp.path} is inside MoE {moe.path or '(the block)'}; left to the MoE")
    return None
