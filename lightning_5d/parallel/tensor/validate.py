"""What tensor parallelism checks before it changes anything: every width it cuts divides by
``tp``, each attention's head counts are known and divide, fused projections have a column
layout it can cut, and sequence parallelism has block forwards to hook. Raised before the
model is touched (and by ``l5d train`` before any process starts)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from lightning_5d.config import LayoutError
from lightning_5d.plan import paths
from lightning_5d.plan.blocks import ModelMappingError
from lightning_5d.plan.model_plan import ColumnLayout, ModelPlan, Projection, ProjectionKind


class TensorParallelError(LayoutError):
    """The model's shapes do not divide by tp; the message names the number and valid tp values."""


def out_features(module: nn.Module, p: Projection) -> int:
    return module.weight.size(1 if p.kind is ProjectionKind.CONV1D else 0)


def in_features(module: nn.Module, p: Projection) -> int:
    return module.weight.size(0 if p.kind is ProjectionKind.CONV1D else 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_tensor_parallel(plan: ModelPlan, root: nn.Module, tp: int) -> None:
    """Every shape TP cuts must divide by ``tp``; raised before anything is changed."""
    if tp == 1:
        return

    def need(value: int, what: str) -> None:
        if value % tp:
            fits = [d for d in _divisors(value) if d > 1]
            raise TensorParallelError(
                f"tp={tp} does not divide {what}={value}; use tp in {fits or [1]} "
                f"(or tp=1 and another dimension for these ranks)."
            )

    need(plan.vocab_size, "vocab_size")
    for i, block_plan in enumerate(plan.block_plans):
        att = block_plan.attention  # None: a feed-forward entry of an alternating block list
        where = f"block {plan.block_path(i)}"
        block = root.get_submodule(plan.block_path(i))
        if att is not None:
            _check_heads(plan, i, att, tp, where, need)
        mlp_col = block_plan.mlp.column if block_plan.mlp else ()
        mlp_row = block_plan.mlp.row if block_plan.mlp else ()
        for p in (att.column if att else ()) + mlp_col:
            if p.layout is ColumnLayout.UNKNOWN:
                raise TensorParallelError(
                    f"tp={tp} cannot cut {where}.{p.path}: the probe forward found its fused output features in an "
                    f"order that is neither [q|k|v] / [gate|up] side by side nor interleaved per head, so no "
                    f"column split keeps each rank's heads whole. Split it into separate linears, or use tp=1 "
                    f"(cp, pp and ZeRO do not cut projections)."
                )
            for seg in p.segments or (out_features(block.get_submodule(p.path), p),):
                need(seg, f"the output features of {where}.{p.path}")
        for p in (att.row if att else ()) + mlp_row:
            need(in_features(block.get_submodule(p.path), p), f"the input features of {where}.{p.path}")


def _check_heads(plan: ModelPlan, i: int, att, tp: int, where: str, need: Callable[[int, str], None]) -> None:
    if not att.num_heads:
        pattern = paths.join(plan.blocks, "*", att.path)
        raise ModelMappingError(
            f"tp={tp} splits attention by heads, but no head count is known for {plan.block_path(i)}.{att.path} "
            f"(the module keeps none and no config declares num_attention_heads / num_heads / n_head). "
            f"Give it in the strategy's model_plan, e.g. model_plan={{{pattern!r}: 'attention(heads=<N>)'}} "
            f"(add kv_heads=<K> for grouped-query attention), or use tp=1."
        )
    if att.num_kv_heads and att.num_kv_heads < tp:
        raise TensorParallelError(
            f"tp={tp} exceeds the {att.num_kv_heads} key/value heads of {where} (grouped-query "
            f"attention): each rank needs at least one whole kv head. Use tp in "
            f"{_divisors(att.num_kv_heads)}; put the other ranks in dp or cp."
        )
    need(att.num_heads, f"num_heads of {where}")
    if att.num_kv_heads:
        need(att.num_kv_heads, f"num_kv_heads of {where}")


def check_block_forwards(plan: ModelPlan, root: nn.Module, tp: int) -> None:
    """Sequence parallelism scatters the residual stream at the first block's input and gathers
    it at the last block's output, both hooks on the block's forward. A block that is a list the
    model iterates (``for attn, ff in self.layers``) has no forward, so neither would run."""
    blocks = plan.blocks_of(root)
    bare = [i for i, b in enumerate(blocks) if isinstance(b, (nn.ModuleList, nn.ModuleDict))]
    if bare:
        raise TensorParallelError(
            f"sequence parallelism (tp={tp}) cuts the sequence at the input of the first block and joins it at the "
            f"output of the last, but the blocks of {plan.blocks} are {type(blocks[bare[0]]).__name__}s with no "
            f"forward of their own, so neither point can be hooked. Give each block a module with a forward (e.g. "
            f"`class Block(nn.Module)` calling its attention and MLP), or use sequence_parallel=false (tp alone "
            f"runs this model)."
        )
