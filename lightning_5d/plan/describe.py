"""``describe``: a plain-text table of a plan, for logs and for checking discovery by eye."""

from __future__ import annotations

import os

from collections.abc import Mapping

from torch import nn

from lightning_5d.plan.discover import discover
from lightning_5d.plan.model_plan import AttentionPlan, BlockPlan, ModelPlan, MoEPlan, Projection

_WIDTH = 20  # label column


def describe(module_or_plan: nn.Module | ModelPlan, explicit: Mapping[str, str] | None = None) -> str:
    """Describe a plan, discovering it first when given a module."""
    plan = module_or_plan if isinstance(module_or_plan, ModelPlan) else discover(module_or_plan, explicit)
    lines = [f"Model plan (source: {plan.source.value})"]
    lines += _model_rows(plan)
    if plan.block_plans:
        lines.append(f"Block 0 ({plan.block_path(0)})")
        lines += _block_rows(plan.block_plans[0])
        later = _later_blocks(plan)
        if later:
            lines.append(later)
    if plan.notes:
        lines.append("Notes")
        lines += [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def _row(label: str, value: str, indent: int = 1) -> str:
    pad = "  " * indent
    return f"{pad}{label:<{_WIDTH - len(pad) + 2}}{value}"


def _model_rows(plan: ModelPlan) -> list[str]:
    head = "-"
    if plan.head:
        head = f"{plan.head} (tied to the embedding)" if plan.tied_head else f"{plan.head} (untied)"
    return [
        _row(
            "embedding",
            f"{plan.embedding} (vocab {plan.vocab_size}, hidden {plan.hidden_size})",
        ),
        _row("position embedding", plan.position_embedding or "-"),
        _row("blocks", f"{plan.blocks} ({plan.num_blocks} blocks)"),
        _row("final norm", plan.final_norm or "-"),
        _row("head", head),
    ]


def _projection(name: str, p: Projection) -> str:
    detail = p.kind.value
    if p.segments:
        detail += ", segments " + "/".join(str(s) for s in p.segments)
    return f"{name}={p.path} [{detail}]"


def _attention_rows(a: AttentionPlan) -> list[str]:
    named = [("qkv", a.qkv)] if a.qkv else [("q", a.q), ("k", a.k), ("v", a.v), ("kv", a.kv)]
    return [
        _row("attention", a.path or "(the block)"),
        _row("column", ", ".join(_projection(n, p) for n, p in named if p), 2),
        _row("row", _projection("o", a.o), 2),
        _row("heads", f"{a.num_heads} (kv {a.num_kv_heads}, head_dim {a.head_dim})" if a.num_heads else "unknown", 2),
        _row("head attributes", ", ".join(a.head_attributes) or "-", 2),
        _row("width reshapes", _sites(a.shape_sites), 2),
        _row("kernel", a.kernel.value, 2),
        *([_row("bias", _bias(a), 2)] if a.per_head_bias or a.linear_bias else []),
    ]


def _bias(a: AttentionPlan) -> str:
    """The attention's observed score bias: ALiBi (proven) or another per-head one."""
    if a.linear_bias is None:
        return "per-head (not slopes x distances)"
    b = a.linear_bias
    slopes = ", ".join(f"{m:.4g}" for m in b.slopes)
    return f"ALiBi {b.form.value}{', causal' if b.causal else ''}; slopes {slopes}"


def _sites(sites: tuple) -> str:
    """The attention forward's reshapes with a full head count or width (tp gives them local sizes)."""
    if not sites:
        return "-"
    lines = dict.fromkeys(f"{os.path.basename(s.key[0])}:{s.key[1]} {s.op}" for s in sites)
    return ", ".join(lines)


def _block_rows(block: BlockPlan) -> list[str]:
    rows = _attention_rows(block.attention) if block.attention is not None else [_row("attention", "none")]
    if block.mlp is not None:
        rows += [
            _row("mlp", block.mlp.path or "(the block)"),
            _row(
                "column",
                ", ".join(_projection("", p).lstrip("=") for p in block.mlp.column),
                2,
            ),
            _row(
                "row",
                ", ".join(_projection("", p).lstrip("=") for p in block.mlp.row),
                2,
            ),
        ]
    else:
        rows.append(_row("mlp", "-"))
    if block.moe is not None:
        m = block.moe
        rows += [
            _row("moe", m.path or "(the block)"),
            _row("router", m.router, 2),
            _row("experts", f"{m.experts} ({m.num_experts} experts, {m.experts_kind.value})", 2),
            _row("top_k", str(m.top_k) if m.top_k else "unknown", 2),
            _row("shared experts", _shared(m), 2),
        ]
    else:
        rows.append(_row("moe", "-"))
    rows.append(_row("norms", ", ".join(block.norms) or "-"))
    return rows


def _shared(m: MoEPlan) -> str:
    if m.shared_experts is None:
        return "-"
    return f"{m.shared_experts} (gate {m.shared_expert_gate})" if m.shared_expert_gate else m.shared_experts


def _later_blocks(plan: ModelPlan) -> str:
    first = plan.block_plans[0]
    differ = [str(i) for i, b in enumerate(plan.block_plans) if b != first]
    if not differ:
        if plan.num_blocks == 1:
            return ""
        rest = "Block 1" if plan.num_blocks == 2 else f"Blocks 1-{plan.num_blocks - 1}"
        return f"{rest}: same as block 0"
    return f"Blocks that differ from block 0: {', '.join(differ)}"
