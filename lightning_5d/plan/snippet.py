"""The config snippet an error message shows: a ``parallel.model_plan`` to fill in.

Parts discovery did find are written with the model's real module names; the missing
ones get ``<placeholders>``. Optional parts that were not found are commented out.
"""

from __future__ import annotations

from lightning_5d.plan import paths
from lightning_5d.plan.hints import BlockHints, TopHints

Line = tuple[str, str, bool]  # pattern, role, commented out


def model_plan_snippet(top: TopHints, block: BlockHints | None) -> str:
    block = block or BlockHints()
    lines = _top_lines(top) + _attention_lines(top, block) + _feed_forward_lines(top, block)
    lines += _norm_lines(top, block) + _tail_lines(top)
    body = "\n".join(f'    {"# " if off else ""}"{pattern}": {role}' for pattern, role, off in lines)
    return (
        f"parallel:\n  model_plan:\n{body}\n"
        "(Replace every <...> with a module path from print(model); `*` stands for "
        "the block index.)"
    )


def _in_block(top: TopHints, inside: str) -> str:
    return paths.join(f"{top.blocks or '<blocks>'}.*", inside)


def _top_lines(top: TopHints) -> list[Line]:
    lines: list[Line] = [(top.embedding or "<token_embedding>", "embedding", False)]
    if top.position_embedding:
        lines.append((top.position_embedding, "position_embedding", False))
    lines.append((top.blocks or "<blocks>", "blocks", False))
    return lines


def _attention_lines(top: TopHints, block: BlockHints) -> list[Line]:
    attention = block.attention
    if attention is None and (block.q or block.qkv):
        attention = paths.common_parent([block.q or block.qkv])
    # Placeholders for the projections go inside the attention module where it is known.
    inside = "<attention>" if attention is None else attention
    heads = f"heads={block.num_heads or '<num_heads>'}, kv_heads={block.num_kv_heads or '<num_kv_heads>'}"
    lines: list[Line] = [(_in_block(top, inside), f"attention({heads})", False)]
    if block.qkv:
        lines.append((_in_block(top, block.qkv), "attention.qkv", False))
    elif block.kv:
        q = block.q or paths.join(inside, "<q_proj>")
        lines += [(_in_block(top, q), "attention.q", False), (_in_block(top, block.kv), "attention.kv", False)]
    else:
        for name in ("q", "k", "v"):
            path = getattr(block, name) or paths.join(inside, f"<{name}_proj>")
            lines.append((_in_block(top, path), f"attention.{name}", False))
    o = block.o or paths.join(inside, "<o_proj>")
    lines.append((_in_block(top, o), "attention.o", False))
    return lines


def _feed_forward_lines(top: TopHints, block: BlockHints) -> list[Line]:
    if block.router and block.experts:
        lines: list[Line] = [
            (_in_block(top, block.router), "moe.router", False),
            (_in_block(top, block.experts), "moe.experts", False),
        ]
        if block.shared_experts:
            lines.append((_in_block(top, block.shared_experts), "moe.shared_experts", False))
        if block.shared_expert_gate:
            lines.append((_in_block(top, block.shared_expert_gate), "moe.shared_expert_gate", False))
        return lines
    mlp = block.mlp or "<mlp>"
    column = block.mlp_column or (f"{mlp}.<up_proj>",)
    row = block.mlp_row or (f"{mlp}.<down_proj>",)
    return [(_in_block(top, p), "mlp.column", False) for p in column] + [
        (_in_block(top, p), "mlp.row", False) for p in row
    ]


def _norm_lines(top: TopHints, block: BlockHints) -> list[Line]:
    if block.norms:
        return [(_in_block(top, n), "norm", False) for n in block.norms]
    return [(_in_block(top, "<norm>"), "norm", True)]


def _tail_lines(top: TopHints) -> list[Line]:
    return [
        (top.final_norm or "<final_norm>", "final_norm", top.final_norm is None),
        (top.head or "<lm_head>", "head", top.head is None),
    ]
