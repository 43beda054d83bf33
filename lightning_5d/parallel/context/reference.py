"""Pure-math attention on one block, returning the block's log-sum-exp: the oracle of the fused kernels.

Same contract as :mod:`lightning_5d.parallel.context.kernel`: ``q`` ``[b, hq, sq, d]``,
``k``/``v`` ``[b, hkv, sk, d]`` with ``hq % hkv == 0`` (grouped-query attention without
repeating K/V), ``causal`` is the top-left aligned mask ``j ≤ i``, ``bias`` an additive
score bias ``[hb, sq, sk]`` (``hb`` 1 or ``hq``; ALiBi). Everything is computed
in fp32 (fp64 stays fp64) and materializes the ``sq × sk`` score matrix, so it costs
O(sq·sk) memory: the tests compare the fused kernels against it, and the kernel module
falls back to it only for a dtype/device no fused kernel takes (fp64 on CUDA).

Backward follows the playbook's derivation: with the *final* (merged) output ``O`` and
log-sum-exp ``lse`` of the rows, ``P = exp(S − lse)`` is the block's slice of the full
softmax, ``D = rowsum(dO ∘ O)`` and ``dS = P ∘ (dO Vᵀ − D)``; so each block's gradients
need no gradient on its own partial ``lse``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["reference_block_forward", "reference_block_backward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: Tensor, hkv: int) -> Tensor:
    b, hq, s, d = q.shape
    return q.reshape(b, hkv, hq // hkv, s, d)


def _scores(q5: Tensor, k: Tensor, scale: float, causal: bool, bias: Tensor | None) -> Tensor:
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if bias is not None:  # [hb, sq, sk] onto the grouped [b, hkv, hq/hkv, sq, sk]
        hkv, groups = q5.shape[1:3]
        s = s + (bias.reshape(1, hkv, groups, *bias.shape[1:]) if bias.size(0) > 1 else bias).to(s.dtype)
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def reference_block_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(O, lse)`` of one block: ``O`` ``[b, hq, sq, d]`` in q's dtype, ``lse`` ``[b, hq, sq]`` fp32/fp64."""
    cdt = _compute_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.size(1)
    s = _scores(_grouped(q.to(cdt), hkv), k.to(cdt), scale, causal, bias)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(cdt).unsqueeze(2))
    return o.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def reference_block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``dQ, dK, dV`` of one block given the rows' final ``out`` / ``lse`` (see the module docstring)."""
    cdt = _compute_dtype(q.dtype)
    b, hq, sq, d = q.shape
    hkv = k.size(1)
    q5, do5 = _grouped(q.to(cdt), hkv), _grouped(dout.to(cdt), hkv)
    kf, vf = k.to(cdt).unsqueeze(2), v.to(cdt).unsqueeze(2)
    lse5 = lse.to(cdt).reshape(b, hkv, hq // hkv, sq)
    delta = (do5 * _grouped(out.to(cdt), hkv)).sum(dim=-1)
    p = torch.exp(_scores(q5, k.to(cdt), scale, causal, bias) - lse5.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(dim=2)
    ds = p * (torch.matmul(do5, vf.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(dim=2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
