"""Fused attention on one (Q block, K/V block) pair, returning the block's log-sum-exp.

Context parallelism computes attention block by block and merges the partial results with
the online softmax (:func:`lightning_5d.parallel.context.ring.merge_partial`), so a block
kernel must return, besides ``O^(j)``, the rows' ``lse^(j) = log Σ_k exp(S_ik)`` (natural
log, fp32), and its backward must accept the rows' *final* ``O`` and ``lse`` (see
:mod:`lightning_5d.parallel.context.reference` for the derivation). PyTorch's fused SDPA
ops do both without materializing the ``sq × sk`` scores, so transient memory is linear in
the block length:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): every dtype,
  grouped-query attention natively (K/V keep their own head count).
* CUDA: ``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``) for fp16/bf16/
  fp32. It does not take fewer K/V heads, so K/V are repeated to the query heads *on the
  device* (the wire still carries them unrepeated) and dK/dV are summed back over each
  group. Its ``lse`` has rows padded to a multiple of 32; only the first ``sq`` are used.
  This branch has not run on a GPU in this project's tests (CPU-only CI).
* anything else (fp64 on CUDA): the pure-math reference.

Shapes: ``q`` ``[b, hq, sq, d]``, ``k``/``v`` ``[b, hkv, sk, d]``, ``hq % hkv == 0``.
``causal=True`` is the top-left aligned mask ``j ≤ i`` and is only used for diagonal
blocks (``sq == sk``), where it is the ordinary causal mask.

``bias``: an additive score bias ``B`` (``S = QKᵀ·scale + B``), ``[hb, sq, sk]`` with ``hb`` 1
or ``hq``, in q's dtype, no gradient (ALiBi rebuilt from positions: :mod:`.ring`). Every
kernel above takes one with its log-sum-exp: the CPU op and its backward as ``attn_mask``,
CUDA's as ``attn_bias`` (rows padded to 16 elements for its alignment, as SDPA itself pads
it), the reference adds it to the scores. It costs an ``hb × sq × sk`` tensor per block.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

from lightning_5d.parallel.context.reference import reference_block_backward, reference_block_forward

__all__ = ["BlockKernel", "select_kernel", "block_forward", "block_backward"]

_CUDA_LSE_ROWS = 32  # the memory-efficient kernel's lse row padding
_CUDA_BIAS_ALIGN = 16  # the memory-efficient kernel's alignment of a bias row (elements)


class BlockKernel(str, Enum):
    FLASH_CPU = "flash_cpu"
    EFFICIENT_CUDA = "efficient_cuda"
    REFERENCE = "reference"


def select_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The fused kernel for tensors on ``device`` of ``dtype`` (the reference where none exists)."""
    if device.type == "cpu":
        return BlockKernel.FLASH_CPU
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32):
        return BlockKernel.EFFICIENT_CUDA
    return BlockKernel.REFERENCE


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    b, hq, s, d = dx.shape
    return dx.view(b, hq // groups, groups, s, d).sum(dim=2)


def _cuda_bias(bias: Tensor | None, b: int, hq: int) -> Tensor | None:
    """``[hb, sq, sk]`` as the memory-efficient kernel wants it: ``[b, hq, sq, sk]`` (expanded, no
    copy) over rows whose stride is a multiple of 16 elements."""
    if bias is None:
        return None
    hb, sq, sk = bias.shape
    padded = bias.new_zeros(hb, sq, -(-sk // _CUDA_BIAS_ALIGN) * _CUDA_BIAS_ALIGN)
    padded[..., :sk].copy_(bias)
    return padded[..., :sk].unsqueeze(0).expand(b, hq, sq, sk)


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(O^(j), lse^(j))``: ``O`` in q's dtype ``[b, hq, sq, d]``, ``lse`` fp32 ``[b, hq, sq]`` (fp64 for fp64)."""
    kernel = select_kernel(q.device, q.dtype)
    if kernel is BlockKernel.FLASH_CPU:
        mask = None if bias is None else bias.unsqueeze(0)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    if kernel is BlockKernel.EFFICIENT_CUDA:
        groups = q.size(1) // k.size(1)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, groups), _repeat_kv(v, groups), _cuda_bias(bias, q.size(0), q.size(1)), True, 0.0,
            causal, scale=scale,
        )  # fmt: skip
        return out, lse[..., : q.size(2)]
    return reference_block_forward(q, k, v, scale, causal, bias)


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``dQ, dK, dV`` of one block from the rows' final ``out`` (q's dtype) and ``lse`` (fp32)."""
    kernel = select_kernel(q.device, q.dtype)
    if kernel is BlockKernel.FLASH_CPU:
        mask = None if bias is None else bias.unsqueeze(0)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    if kernel is BlockKernel.EFFICIENT_CUDA:
        groups = q.size(1) // k.size(1)
        rows = -(-q.size(2) // _CUDA_LSE_ROWS) * _CUDA_LSE_ROWS
        lse_padded = torch.nn.functional.pad(lse.float(), (0, rows - q.size(2)))
        no_rng = torch.empty((), dtype=torch.long)  # dropout 0: the philox seed/offset are unused
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, groups), _repeat_kv(v, groups), _cuda_bias(bias, q.size(0), q.size(1)), out,
            lse_padded, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
    return reference_block_backward(dout, q, k, v, out, lse, scale, causal, bias)
