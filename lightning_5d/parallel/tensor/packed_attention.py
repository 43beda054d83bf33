"""Tensor parallelism of ``nn.MultiheadAttention``: a rank's heads of its packed in-projection.

``nn.MultiheadAttention`` holds q, k and v in one ``in_proj_weight`` ``[3E, E]`` (``[W_q|W_k|W_v]``
stacked on the rows) and calls ``F.multi_head_attention_forward``, which reads ``3 x embed_dim``
rows and multiplies by ``out_proj.weight`` itself, so it cannot run a slice of the heads. Here,
as in Megatron-LM's attention, rank ``r`` of ``t`` keeps

    in_proj_weight  [q_r | k_r | v_r]   the rows of its H/t heads in each of the three segments  (column)
    in_proj_bias    [q_r | k_r | v_r]   the same entries of the bias
    out_proj.weight [E, E/t]            the columns of its heads                                  (row)

and the module's forward is replaced by :func:`local_heads_forward`, which computes
``softmax(Q_r K_r^T / sqrt(d) + M) V_r`` for its heads with ``F.scaled_dot_product_attention``
and calls ``out_proj`` as a module: tensor parallelism gives that module a row-parallel forward
(partial product, then g = all-reduce, or g* = reduce-scatter under sequence parallelism, then
the bias once). The parameters keep their names and classes, so checkpoints and per-shard
loading see the module as before. The input side (f / f*) is :func:`map_qkv_inputs`.

Supported: what ``nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` pass (``attn_mask``
2-D or per-head 3-D, bool or float, ``is_causal``, ``key_padding_mask``, ``need_weights=False``),
batched or unbatched inputs, ``batch_first`` either way, with or without biases, dropout.
Refused before training: ``add_bias_kv`` / ``add_zero_attn`` (:func:`check_supported`), and at the
first (probe) forward ``need_weights=True``, whose averaged weights need every head.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_5d.config import LayoutError

_QKV = ("query", "key", "value")


class PackedAttentionError(LayoutError):
    """An ``nn.MultiheadAttention`` setting tensor parallelism cannot split by heads."""


def check_supported(module: nn.MultiheadAttention, where: str, tp: int) -> None:
    """Refuse the settings whose extra key/value entries are shared by all heads (before any change)."""
    if module.bias_k is not None or module.add_zero_attn:
        setting = "add_bias_kv=True" if module.bias_k is not None else "add_zero_attn=True"
        raise PackedAttentionError(
            f"tp={tp} cannot cut {where} (nn.MultiheadAttention with {setting}): the extra key/value "
            f"position it appends is not split by heads here. Build it without {setting}, or use tp=1 "
            f"(ZeRO-3 and pp run it unchanged)."
        )


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """nn.MultiheadAttention's convention: a bool mask is True where attention is NOT allowed."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _local_heads_mask(mask: Tensor, batch: int, heads: int, rank: int, tp: int) -> Tensor:
    """A per-head ``[N*H, L, S]`` mask -> this rank's ``[N, H/t, L, S]`` (heads r*H/t ... of each sample)."""
    per_head = mask.view(batch, heads, *mask.shape[1:])
    local = heads // tp
    return per_head[:, rank * local : (rank + 1) * local]


def local_heads_forward(module: nn.MultiheadAttention, rank: int, tp: int) -> Callable[..., tuple[Tensor, None]]:
    """nn.MultiheadAttention.forward for this rank's ``H/t`` heads (module attributes already local:
    ``num_heads = H/t``, ``embed_dim = E/t``, ``head_dim = E/H``). Returns ``(output, None)`` as torch's
    does with ``need_weights=False``; ``out_proj`` (row-parallel) sums the heads over tp."""
    full_heads = module.num_heads * tp  # the module's attributes are local when this runs

    def forward(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, None]:
        if need_weights:
            raise PackedAttentionError(
                f"nn.MultiheadAttention under tp={tp} was called with need_weights=True (its default): the "
                f"attention weights averaged over heads need every head, and each tp rank holds {module.num_heads}"
                f" of {full_heads}. Pass need_weights=False where the model calls it (nn.TransformerEncoderLayer "
                f"does), or use tp=1."
            )
        self_attention = query is key and key is value  # before the transposes make new tensors
        batched = query.dim() == 3
        if not batched:  # [L, E] -> [L, 1, E] (torch ignores batch_first for unbatched inputs)
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif module.batch_first:  # work in torch's [L, N, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        tgt_len, batch, _ = query.shape
        src_len = key.size(0)
        heads, head_dim, width = module.num_heads, module.head_dim, module.embed_dim  # local H/t, d, E/t

        weight, bias = module.in_proj_weight, module.in_proj_bias
        if self_attention:  # one GEMM over [q_r|k_r|v_r]
            q, k, v = F.linear(query, weight, bias).split(width, dim=-1)
        else:
            w = weight.split(width)
            b = bias.split(width) if bias is not None else (None, None, None)
            q, k, v = (F.linear(x, w[i], b[i]) for i, x in enumerate((query, key, value)))

        # Masks as torch combines them: with is_causal and no padding mask, SDPA's causal flag
        # replaces the (causal) attn_mask; otherwise an additive float mask.
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention).")
        mask = None
        if is_causal and key_padding_mask is None:
            causal = True
        else:
            causal = False
            mask = _float_mask(attn_mask, q.dtype)
            if mask is not None:
                mask = _local_heads_mask(mask, batch, full_heads, rank, tp) if mask.dim() == 3 else mask
            padding = _float_mask(key_padding_mask, q.dtype)
            if padding is not None:
                padding = padding.view(batch, 1, 1, src_len)
                mask = padding if mask is None else mask + padding

        # [L, N, E/t] -> [N, H/t, L, d]
        q, k, v = (t.reshape(t.size(0), batch, heads, head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        dropout = module.dropout if module.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, batch, width)  # [L, N, E/t]
        if not batched:
            out = out.squeeze(1)
        elif module.batch_first:
            out = out.transpose(0, 1)
        return module.out_proj(out), None  # row-parallel: partial sum over tp, reduced, + bias

    return forward


def map_qkv_inputs(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor], shared_only: bool, where: str):
    """Apply f (or f*) to query, key and value, once per distinct tensor: self-attention passes the
    same tensor three times, and q, k and v must share its one collective (and its gradient sum).

    ``shared_only`` (sequence parallelism): a key/value that is not the query is refused, since
    whether it is a sequence shard (gather it) or a full tensor (leave it) cannot be told here."""
    args = list(args)
    kwargs = dict(kwargs)

    def get(i: int) -> Any:
        return args[i] if i < len(args) else kwargs.get(_QKV[i])

    def put(i: int, value: Tensor) -> None:
        if i < len(args):
            args[i] = value
        else:
            kwargs[_QKV[i]] = value

    done: dict[int, Tensor] = {}
    query = get(0)
    for i in range(3):
        t = get(i)
        if not isinstance(t, Tensor):
            continue
        if id(t) not in done:
            if shared_only and t is not query:
                raise PackedAttentionError(
                    f"sequence parallelism cannot tell whether the {_QKV[i]} passed to {where} "
                    f"(nn.MultiheadAttention) is a sequence shard: it is not the query tensor (cross-attention). "
                    f"Use sequence_parallel=false for this model, or tp=1."
                )
            done[id(t)] = fn(t)
        put(i, done[id(t)])
    return tuple(args), kwargs
