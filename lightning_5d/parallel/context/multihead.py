"""Context parallelism of ``nn.MultiheadAttention``: its SDPA call routed, its masks read first.

torch's forward calls ``F.scaled_dot_product_attention`` inside ``F.multi_head_attention_forward``,
out of reach of the routing ``TorchFunctionMode``. The module runs the forward built from its parts
(:mod:`lightning_5d.mha_parts`) instead, whose own SDPA call the route turns into ring attention.

Ring attention applies causal (or full) attention over the whole sequence itself and takes no
mask, while the module is handed masks built from the rank's shard (``generate_square_subsequent_mask``
of the local length). While a shard is current, :func:`ring_masks` therefore decides before the call:

* ``is_causal=True`` (nn.TransformerEncoder detects or passes it): causal, the mask dropped as torch drops it;
* no mask: full attention over the sequence (an encoder without a mask);
* a 2-D ``[L, L]`` or per-head 3-D mask that is exactly causal (0 on and below the diagonal, -inf or the
  dtype's lowest value above; float or bool): causal, after the cp ranks agree, so that a mask
  whose content differs per rank cannot send one rank into the ring and another into an error;
* anything else, and any ``key_padding_mask``: refused, naming the fix.

``need_weights=True`` is refused (ring attention computes no weights), and so are ``add_bias_kv`` /
``add_zero_attn``, whose extra key position is not part of the sequence the ring passes around.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_5d.mha_parts import own_forward
from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.parallel.context.state import ContextState


def prepare_multihead(cp: ContextState, attention: nn.MultiheadAttention, where: str) -> None:
    """Give ``attention`` the forward built from its parts, checking its masks for ring attention."""
    if attention.bias_k is not None or attention.add_zero_attn:
        setting = "add_bias_kv=True" if attention.bias_k is not None else "add_zero_attn=True"
        raise ContextParallelError(
            f"{where} is nn.MultiheadAttention with {setting}: the extra key/value position it appends is not part "
            f"of the sequence ring attention passes between the cp={cp.size} ranks. Build it without {setting}, or "
            f"use cp=1."
        )
    parts = own_forward(attention)
    parts.weights_refused["cp"] = (
        f"{where} was called with need_weights=True (nn.MultiheadAttention's default): under cp={cp.size} ring "
        f"attention computes softmax(QKᵀ)V without the weights, and each rank holds a part of the keys. Pass "
        f"need_weights=False where the model calls it (nn.TransformerEncoderLayer does), or use cp=1."
    )
    parts.masks = functools.partial(ring_masks, cp, where)


def ring_masks(
    cp: ContextState, where: str, attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool,
    tgt_len: int, src_len: int,
) -> tuple[Tensor | None, bool]:  # fmt: skip
    """(mask, causal) for the routed SDPA call; see the module docstring."""
    if cp.current is None:  # outside a step the module runs unrouted, masks as given
        return attn_mask, is_causal
    if key_padding_mask is not None:
        raise ContextParallelError(
            f"{where} (nn.MultiheadAttention) got a key_padding_mask; ring attention under cp={cp.size} takes no "
            f"mask, and each rank holds only its part of the keys. Pack or right-pad the sequences, mark padded "
            f"positions with label -100 and drop the key_padding_mask (right padding is then exact), or use cp=1."
        )
    if is_causal or attn_mask is None:
        return None, is_causal
    causal = torch.tensor([int(is_causal_mask(attn_mask, tgt_len, src_len))], device=attn_mask.device)
    dist.all_reduce(causal, op=dist.ReduceOp.MIN, group=cp.group)
    if not causal.item():
        raise ContextParallelError(
            f"{where} (nn.MultiheadAttention) got an attn_mask of shape {tuple(attn_mask.shape)} that is not a causal "
            f"mask (on some cp rank); ring attention under cp={cp.size} applies causal or full attention itself and "
            f"takes no other mask. Pass a causal mask (nn.Transformer.generate_square_subsequent_mask) or none, or "
            f"use cp=1."
        )
    return None, True


def is_causal_mask(mask: Tensor, tgt_len: int, src_len: int) -> bool:
    """Whether a float mask ([L, S] or per head [N*H, L, S], as the module canonicalized it) allows
    exactly the keys at or before each query: 0 there, -inf (or the dtype's lowest value) after."""
    if tgt_len != src_len or mask.shape[-2:] != (tgt_len, src_len):
        return False
    future = torch.ones(tgt_len, src_len, dtype=torch.bool, device=mask.device).triu(1)
    blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
    return bool(torch.equal(blocked, future.expand_as(mask)) and (mask.masked_fill(future, 0) == 0).all())
