"""Activation checkpointing per transformer block.

``full`` keeps only each block's input and recomputes the block in backward
(Korthikanti's "full recompute", 2sbh bytes per layer of 16-bit activations).
``selective`` keeps the outputs of matmuls and attention kernels and recomputes the
cheap element-wise ops between them (norms, activations, RoPE, residual adds): most of
the memory of the element-wise intermediates for a few percent more compute. On
kernels that materialize the softmax (the math SDPA backend) this also drops the
attention-matrix term that Korthikanti's selective recompute targets.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_5d.config import ActivationCheckpointing

_aten = torch.ops.aten
_SAVE_OUTPUTS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


_WRAPPED = "_l5d_activation_checkpointed"


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OUTPUTS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: ActivationCheckpointing) -> None:
    """Wrap each block's forward in place (module names and state-dict keys unchanged)."""
    mode = ActivationCheckpointing(mode)
    if mode == ActivationCheckpointing.NONE:
        return
    kwargs = {"use_reentrant": False}
    if mode == ActivationCheckpointing.SELECTIVE:
        kwargs["context_fn"] = _selective_context
    for block in blocks:
        if getattr(block, _WRAPPED, False):
            continue  # a second Trainer on the same module: recomputing twice would waste work
        inner = block.forward
        block.forward = functools.wraps(inner)(functools.partial(checkpoint, inner, **kwargs))  # type: ignore[method-assign]
        setattr(block, _WRAPPED, True)
