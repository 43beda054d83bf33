"""Per-head attention biases (ALiBi) under tensor parallelism.

An attention module that builds its bias inside its forward from its head count, e.g.

    bias[h, i, j] = -2^(-8 (h + 1) / H) * (i - j)          (Press et al., ALiBi; H heads)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

reads the same attribute (``self.heads``) that tensor parallelism divides by tp so that the
module's reshapes fit the rank's H/tp heads. The bias it then builds has the slopes of H/tp
heads numbered from 0, not those of the rank's heads r*H/tp .. (r+1)*H/tp - 1: it trains, with
the wrong slopes. The discovery probe marks such attentions (``AttentionPlan.per_head_bias``).

Here each call first builds the full model's bias: the forward runs once more up to its
attention call with the full head counts restored and every column projection returning zeros
of its full width (the bias depends on head counts and lengths, not on q, k, v), and the
``attn_mask`` it passes is kept; the real call then gets the rank's rows of it along the head
dimension. The replay costs one pass through the attention's code before the kernel, without
its matmuls; the attention's layers run with their hooks off during it (nothing else sees it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.forward_patch import replace_forward


class _Captured(Exception):
    def __init__(self, mask: Tensor | None) -> None:
        super().__init__("attention mask captured")
        self.mask = mask


def _mask_of(args: tuple, kwargs: dict) -> Tensor | None:
    return kwargs.get("attn_mask", args[3] if len(args) > 3 else None)


class _CaptureMask(TorchFunctionMode):
    """Stops the replay at its attention call, with the mask it was given."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            raise _Captured(_mask_of(args, kwargs))
        return func(*args, **kwargs)


class _GiveMask(TorchFunctionMode):
    """The real call: its attention kernel gets ``mask`` instead of the one the code built."""

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            if len(args) > 3:
                args = (*args[:3], self.mask, *args[4:])
            else:
                kwargs = {**kwargs, "attn_mask": self.mask}
        return func(*args, **kwargs)


def _zeros_of_width(width: int) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor, *_args: Any, **_kwargs: Any) -> Tensor:
        return x.new_zeros(*x.shape[:-1], width)

    return forward


def wrap_per_head_bias(
    attention: nn.Module,
    full_attributes: dict[str, int],
    columns: dict[nn.Module, int],
    heads: int,
    rank: int,
    tp: int,
) -> None:
    """Give ``attention`` (already cut: local attributes and column shards) a forward whose
    attention kernel gets the full model's per-head bias, rows of this rank's heads.

    ``full_attributes``: head attributes at their full values; ``columns``: each column
    projection -> its full output width; ``heads``: the full query head count."""
    original = attention.forward
    local = heads // tp
    rows = slice(rank * local, (rank + 1) * local)

    def full_mask(args: tuple, kwargs: dict) -> Tensor | None:
        saved = {name: getattr(attention, name) for name in full_attributes}
        with ExitStack() as undo, torch.no_grad():
            for name, value in full_attributes.items():
                setattr(attention, name, value)
            undo.callback(lambda: [setattr(attention, n, v) for n, v in saved.items()])
            # Invisible to the layers' hooks (the plan verifier's recorder, FSDP, ...): the
            # replay's zeros must not be taken for the layers' outputs.
            for module in list(attention.modules())[1:]:
                undo.enter_context(_hooks_off(module))
            for module, width in columns.items():
                undo.callback(replace_forward(module, _zeros_of_width(width)))
            try:
                with _CaptureMask():
                    original(*args, **kwargs)
            except _Captured as found:
                return found.mask
        return None

    def forward(*args: Any, **kwargs: Any) -> Any:
        mask = full_mask(args, kwargs)
        if mask is None or mask.dim() < 3 or mask.size(-3) != heads:
            raise RuntimeError(
                f"tensor parallelism expected {type(attention).__name__} to pass a per-head attn_mask with "
                f"{heads} heads to F.scaled_dot_product_attention (as the discovery probe saw), got "
                f"{None if mask is None else tuple(mask.shape)}; use tp=1 for this model."
            )
        with _GiveMask(mask[..., rows, :, :]):
            return original(*args, **kwargs)

    attention.forward = forward


@contextmanager
def _hooks_off(module: nn.Module) -> Iterator[None]:
    saved = module._forward_pre_hooks, module._forward_hooks
    module._forward_pre_hooks, module._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        module._forward_pre_hooks, module._forward_hooks = saved


