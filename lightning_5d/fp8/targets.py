"""Which linear layers compute in FP8: the block projections model discovery found.

nn.MultiheadAttention counts too: its out_proj is an nn.Linear, and its in-projection (a bare
``in_proj_weight``) gets FP8 GEMMs of its own (:func:`fp8_attention_targets`, ``fp8.attention``).

Attention and MLP projections, and the expert (and shared-expert) MLPs of a MoE, are the
GEMMs that dominate a transformer's FLOPs. The head sees the whole vocabulary's logits and
the router decides where tokens go, so both stay bf16 unless asked. GPT-2's Conv1D and
grouped experts ([E, ...] weights called with routing indices) are not nn.Linear and stay bf16.
"""

from __future__ import annotations

from torch import nn

from lightning_5d.plan.model_plan import ExpertsKind, ModelPlan, ProjectionKind


def fp8_targets(
    plan: ModelPlan, root: nn.Module, keep_head_bf16: bool = True, keep_router_bf16: bool = True
) -> list[str]:
    names: list[str] = []

    def add(path: str) -> None:
        if isinstance(root.get_submodule(path), nn.Linear) and path not in names:
            names.append(path)

    def add_linears_under(path: str) -> None:
        for sub, module in root.get_submodule(path).named_modules():
            if isinstance(module, nn.Linear):
                add(f"{path}.{sub}" if sub else path)

    for i, block in enumerate(plan.block_plans):
        prefix = plan.block_path(i)
        attention = block.attention
        # nn.MultiheadAttention: its out_proj here, its in-projection in fp8_attention_targets.
        projections = [] if attention is None else list(attention.column) + list(attention.row)
        if block.mlp is not None:
            projections += list(block.mlp.column) + list(block.mlp.row)
        for p in projections:
            if p.kind is ProjectionKind.LINEAR:
                add(f"{prefix}.{p.path}")
        moe = block.moe
        if moe is not None:
            if moe.experts_kind is ExpertsKind.MODULE_LIST:
                add_linears_under(f"{prefix}.{moe.experts}")
            if moe.shared_experts is not None:
                add_linears_under(f"{prefix}.{moe.shared_experts}")
            if not keep_router_bf16:
                add(f"{prefix}.{moe.router}")
    if not keep_head_bf16 and plan.head is not None and not plan.tied_head:
        add(plan.head)
    return names


def fp8_attention_targets(plan: ModelPlan) -> list[str]:
    """The nn.MultiheadAttention modules whose in-projection (a bare parameter, not an nn.Linear)
    computes in FP8 through ``fp8.attention`` (their out_proj is among :func:`fp8_targets`)."""
    return [f"{plan.block_path(i)}.{att.path}" for i, att in plan.attentions if att.packed]
