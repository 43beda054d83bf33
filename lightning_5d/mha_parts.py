"""``nn.MultiheadAttention``'s forward built from its own parts, for the dimensions that reach inside.

torch's forward hands everything to ``F.multi_head_attention_forward``, one torch function that
multiplies by ``in_proj_weight`` and ``out_proj.weight`` itself and calls
``F.scaled_dot_product_attention`` inside. No dimension can act on a piece of it: FP8 cannot put
its GEMMs on the projections (the out_proj *module* is never called), cp cannot route the SDPA call
(a ``TorchFunctionMode`` sees only the outer call), tp cannot run a slice of the heads.
:func:`own_forward` gives the module :func:`parts_forward` instead (once; every dimension that needs
it then adjusts the one :class:`MhaParts` the module carries). With N the batch, L queries,
S keys, E = ``embed_dim``, H = ``num_heads``, d = E / H:

    q, k, v   in-projection: rows [W_q | W_k | W_v] of ``in_proj_weight`` (or ``q/k/v_proj_weight``)
              + ``in_proj_bias``, one GEMM per distinct input; a GEMM module registered as
              ``<weight name>_gemm`` (FP8's) runs it, else ``F.linear``
    k, v      + one ``bias_k`` / ``bias_v`` position (``add_bias_kv``); split into heads [N*H, ., d];
              + one zero position (``add_zero_attn``)
    M         ``attn_mask`` ([L, S] or per head [N*H, L, S]; bool True = not allowed -> -inf)
              + ``key_padding_mask`` [N, S]; ``is_causal`` without a padding mask: SDPA's causal flag
    out       softmax(q kᵀ / sqrt(d) + M) v: ``F.scaled_dot_product_attention``, or, for
              ``need_weights=True``, spelled out as torch does to return the weights (mean over
              heads unless ``average_attn_weights=False``); dropout ``module.dropout`` in training
    y         ``module.out_proj(out)``, called as a module (tp's row-parallel forward, FP8's linear)

The numbers are torch's (tests/unit/test_mha_parts.py: fp32 within 1e-6 over the option matrix).
Parameters keep their names and classes, so checkpoints see the module as before.

Under tp the module's ``num_heads`` / ``embed_dim`` are the rank's (H/t, E/t) and
:attr:`MhaParts.first_head` says which heads a per-head mask's slices belong to. A dimension
that cannot return attention weights (tp holds some heads, cp some keys) adds its reason to
:attr:`MhaParts.weights_refused`; ``need_weights=True`` then raises that reason. cp sets
:attr:`MhaParts.masks` to check (and turn into the causal flag) the masks before its routed SDPA.
"""

from __future__ import annotations

import math
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_5d.config import LayoutError
from lightning_5d.forward_patch import replace_forward

_ATTRIBUTE = "_lightning_5d_mha_parts"
# The in-projection weights a module may hold; a GEMM module registered as gemm_name(weight) computes it.
IN_PROJECTION_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")

# (attn_mask, key_padding_mask, is_causal, tgt_len, src_len) -> (attn_mask, is_causal) for SDPA
MaskRule = Callable[[Tensor | None, Tensor | None, bool, int, int], tuple[Tensor | None, bool]]


class MhaPartsError(LayoutError):
    """A call an nn.MultiheadAttention cannot take under the dimensions applied to it."""


def gemm_name(weight: str) -> str:
    """The submodule name of the GEMM that computes ``x @ weight.T`` in place of F.linear."""
    return f"{weight}_gemm"


@dataclass
class MhaParts:
    """What the dimensions set on one rebuilt nn.MultiheadAttention."""

    heads: int  # H of the whole module: a per-head [N*H, L, S] mask holds this many slices per sample
    first_head: int = 0  # tp: the first of this rank's heads
    weights_refused: dict[str, str] = field(default_factory=dict)  # dimension -> why need_weights=True fails
    masks: MaskRule | None = None  # cp: checks the masks of the routed SDPA call (need_weights=False)

    def __deepcopy__(self, memo: dict) -> "MhaParts":
        # cp's rule holds its process group: a copy of the model shares it, as it shares the
        # routing wrapper around the forward.
        return MhaParts(self.heads, self.first_head, dict(self.weights_refused), self.masks)


def parts_of(module: nn.Module) -> MhaParts | None:
    return vars(module).get(_ATTRIBUTE)


def own_forward(module: nn.MultiheadAttention) -> MhaParts:
    """Give ``module`` :func:`parts_forward` (if no dimension did yet) and return its settings.

    A forward pre-hook (doing nothing) goes on the module too: nn.TransformerEncoderLayer's fused
    inference path (``torch._transformer_encoder_layer_fwd``, taken in eval mode without gradients)
    reads in_proj_weight and out_proj.weight itself and never calls this forward, and torch skips
    that path whenever a module of the layer carries a hook.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"own_forward expects an nn.MultiheadAttention, got {type(module).__name__}")
    parts = parts_of(module)
    if parts is None:
        _install(module)
        parts = parts_of(module)
    return parts  # type: ignore[return-value]


def _install(module: nn.MultiheadAttention) -> Callable[[], None]:
    """Put the parts forward (and the hook) on ``module``; the returned function takes them off."""
    setattr(module, _ATTRIBUTE, MhaParts(heads=module.num_heads))
    # A bound method (not a closure): a deepcopy of the model then calls its own copy.
    undo_forward = replace_forward(module, types.MethodType(parts_forward, module))
    handle = module.register_forward_pre_hook(_no_fused_path)

    def undo() -> None:
        handle.remove()
        undo_forward()
        delattr(module, _ATTRIBUTE)

    return undo


@contextmanager
def parts_forwards(root: nn.Module) -> Iterator[None]:
    """Every nn.MultiheadAttention under ``root`` runs :func:`parts_forward` for a while, then its own
    forward again: discovery's probes see its SDPA call (a ``TorchFunctionMode`` cannot see the one
    inside ``F.multi_head_attention_forward``) with torch's numbers."""
    undo = [_install(m) for m in root.modules() if isinstance(m, nn.MultiheadAttention) and parts_of(m) is None]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def _no_fused_path(_module: nn.Module, _args: tuple) -> None:
    return None  # see own_forward: its presence turns torch's fused encoder-layer path off


def _float_mask(mask: Tensor | None, dtype: torch.dtype, name: str) -> Tensor | None:
    """torch's convention: a bool mask is True where attention is NOT allowed (-inf added)."""
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype != torch.bool:
        raise AssertionError(f"only bool and floating types of {name} are supported")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _project(module: nn.Module, name: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    gemm = module._modules.get(gemm_name(name))
    return F.linear(x, weight, bias) if gemm is None else gemm(x, weight, bias)


def _in_projection(
    module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor, width: int
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """q, k, v ([., ., width] each) with one GEMM per distinct input, as torch groups them."""
    bias = module.in_proj_bias
    biases = bias.split(width) if bias is not None else (None, None, None)
    if not module._qkv_same_embed_dim:  # kdim / vdim: three weights of their own
        names = IN_PROJECTION_WEIGHTS[1:]
        return tuple(  # type: ignore[return-value]
            _project(module, n, x, getattr(module, n), b) for n, x, b in zip(names, (query, key, value), biases)
        )
    weight, name = module.in_proj_weight, IN_PROJECTION_WEIGHTS[0]
    if key is value and query is key:  # self-attention: [q|k|v] in one GEMM
        return _project(module, name, query, weight, bias).split(width, dim=-1)  # type: ignore[return-value]
    w_q, w_k, w_v = weight.split(width)
    q = _project(module, name, query, w_q, biases[0])
    if key is value:  # encoder-decoder attention: [k|v] in one GEMM
        b_kv = None if bias is None else bias[width:]
        k, v = _project(module, name, key, weight[width:], b_kv).split(width, dim=-1)
        return q, k, v
    return q, _project(module, name, key, w_k, biases[1]), _project(module, name, value, w_v, biases[2])


def _local_heads(mask: Tensor, parts: MhaParts, batch: int, heads: int) -> Tensor:
    """A per-head mask [N*H, L, S] of the whole module -> the slices of this module's heads."""
    if heads == parts.heads:
        return mask
    per_head = mask.view(batch, parts.heads, *mask.shape[1:])
    return per_head[:, parts.first_head : parts.first_head + heads].reshape(batch * heads, *mask.shape[1:])


def _nested_forward(
    module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
    need_weights: bool, attn_mask: Tensor | None, average_attn_weights: bool, is_causal: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Nested (ragged) self-attention input, as nn.TransformerEncoder makes in inference from a padding
    mask (``enable_nested_tensor``; torch's own forward takes it only on its fused path, which reads the
    weights itself): padded with the padding as ``key_padding_mask``, run, and made nested again."""
    one_input = query is key and key is value and module.batch_first
    if not one_input or key_padding_mask is not None or attn_mask is not None:
        raise MhaPartsError(
            "nn.MultiheadAttention got nested tensors other than one batch_first self-attention input without "
            "masks (what nn.TransformerEncoder passes in inference); pass padded tensors with a key_padding_mask."
        )
    lengths = [t.size(0) for t in query.unbind()]
    padded = query.to_padded_tensor(0.0)
    padding = torch.arange(padded.size(1), device=padded.device) >= torch.tensor(lengths, device=padded.device)[:, None]
    out, weights = parts_forward(module, padded, padded, padded, padding, need_weights, attn_mask,
                                 average_attn_weights, is_causal)  # fmt: skip
    return torch.nested.nested_tensor([o[:n] for o, n in zip(out.unbind(), lengths)]), weights


def parts_forward(
    self: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """nn.MultiheadAttention.forward from the module's parts (the module docstring's steps)."""
    parts = parts_of(self)
    assert parts is not None, "parts_forward runs on a module own_forward prepared"
    if need_weights and parts.weights_refused:
        raise MhaPartsError(" ".join(parts.weights_refused.values()))
    if query.is_nested or key.is_nested or value.is_nested:
        return _nested_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                               average_attn_weights, is_causal)  # fmt: skip
    self_attention, kv_shared = query is key and key is value, key is value  # before transposes copy
    batched = query.dim() == 3
    if not batched:  # [L, E] -> [L, 1, E]; torch ignores batch_first for unbatched inputs
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif self.batch_first:  # work in torch's [L, N, E]
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if self_attention:
        key = value = query
    elif kv_shared:
        value = key
    tgt_len, batch, _ = query.shape
    heads, width = self.num_heads, self.embed_dim  # the rank's under tp (H/t, E/t)
    head_dim = width // heads

    key_padding_mask = _float_mask(key_padding_mask, query.dtype, "key_padding_mask")
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # torch's rule: the hint replaces the (causal) mask with SDPA's flag
    else:
        attn_mask = _float_mask(attn_mask, query.dtype, "attn_mask")
        if key_padding_mask is not None:
            is_causal = False  # the merged mask is no longer causal

    q, k, v = _in_projection(self, query, key, value, width)
    src_len = k.size(0)
    if parts.masks is not None and not need_weights:  # cp: before any mask is merged or padded
        attn_mask, is_causal = parts.masks(attn_mask, key_padding_mask, is_causal, tgt_len, src_len)
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
                )
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            full = (batch * parts.heads, tgt_len, src_len)
            if attn_mask.shape != full:
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {full}.")
            attn_mask = _local_heads(attn_mask, parts, batch, heads)
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if self.bias_k is not None and self.bias_v is not None:  # one more key/value position
        k = torch.cat([k, self.bias_k.repeat(1, batch, 1)])
        v = torch.cat([v, self.bias_v.repeat(1, batch, 1)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))

    # [L, N, E] -> [N*H, L, d]
    q = q.reshape(tgt_len, batch * heads, head_dim).transpose(0, 1)
    k = k.reshape(k.size(0), batch * heads, head_dim).transpose(0, 1)
    v = v.reshape(v.size(0), batch * heads, head_dim).transpose(0, 1)
    if self.add_zero_attn:  # one more all-zero key/value position per head
        zeros = torch.zeros((batch * heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, src_len):
            raise AssertionError(
                f"expecting key_padding_mask shape of {(batch, src_len)}, but got {key_padding_mask.shape}"
            )
        padding = key_padding_mask.view(batch, 1, 1, src_len).expand(-1, heads, -1, -1)
        padding = padding.reshape(batch * heads, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout = self.dropout if self.training else 0.0

    if need_weights:  # spelled out, as torch does, to return the weights
        if attn_mask is None:
            scores = torch.bmm(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        else:
            scores = torch.baddbmm(attn_mask, q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        weights = torch.softmax(scores, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len, batch, width)
        weights = weights.view(batch, heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:  # [1, L, S] -> [1, 1, L, S]; [N*H, L, S] -> [N, H, L, S]
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(batch, heads, -1, src_len)
        q, k, v = (t.view(batch, heads, t.size(1), head_dim) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, batch, width)  # [L, N, E]
        weights = None
    # Back to the caller's layout before out_proj: under sequence parallelism its row-parallel
    # forward reduce-scatters along the residual stream's sequence dimension, which is the caller's.
    if not batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    elif self.batch_first:
        out = out.transpose(0, 1)
    return self.out_proj(out), weights
