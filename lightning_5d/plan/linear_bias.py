"""Reading an attention bias as ALiBi: per-head slopes times token distances, proven on the tensor.

ALiBi (Press et al.) adds to the attention scores of head ``h``

    B[h, i, j] = m_h · δ(i, j)        m_h: the head's slope, i: query position, j: key position

with one of the distances people write, and usually the causal mask (``-inf`` where ``j > i``)
folded into the same tensor. A bias of that shape depends on positions only, so context
parallelism can rebuild any block of it from the *global* positions of its queries and keys
(:mod:`lightning_5d.parallel.context.ring`) instead of the shard-local ones the model used.

Which written forms are the same attention. Softmax over the keys of row ``i`` is unchanged by
adding a constant ``c_i`` to every score of that row (``e^(s+c) / Σ e^(s+c) = e^s / Σ e^s``),
so a bias is only defined up to a per-row constant:

* ``m·(j − i)`` (:attr:`DistanceForm.KEY_MINUS_QUERY`) and ``m·j`` (absolute key position, as
  Hugging Face's BLOOM builds it) differ by ``c_i = m·i``: the same attention, masked or not;
* ``−m·|i − j|`` (:attr:`DistanceForm.NEGATIVE_ABSOLUTE`) equals ``m·(j − i)`` wherever
  ``j ≤ i``; under the causal mask those are the only scores kept, so it is the same attention
  too. Without the mask it differs on ``j > i`` by ``−2m·(j − i)``, not a per-row constant: a
  different (symmetric, encoder-style) attention, kept as its own form.

:func:`read_linear_bias` proves the shape on the tensor itself rather than trusting a name:
the ``-inf`` entries are none or exactly ``j > i``; the slope is read from two entries of a row;
and every kept entry minus its row's diagonal entry (the row constant) must equal
``m_h · δ(i, j)`` to a few units in the last place. A learned bias (one that requires grad)
is never read: its gradient would be lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

__all__ = ["DistanceForm", "LinearBias", "read_linear_bias"]

_ULPS = 16  # rounding allowed between m·j − m·i and m·(j − i), in units of the mask dtype's epsilon


class DistanceForm(str, Enum):
    """``δ(i, j)`` of a bias ``m_h · δ(i, j)`` (up to a per-row constant; see the module docstring)."""

    KEY_MINUS_QUERY = "key_minus_query"  # j − i (also m·j; and −|i − j| under the causal mask)
    NEGATIVE_ABSOLUTE = "negative_absolute"  # −|i − j| without a causal mask (symmetric)


@dataclass(frozen=True)
class LinearBias:
    """A bias proven to be ``slopes[h] · δ(i, j)`` plus a per-row constant, ``-inf`` where ``j > i``
    when ``causal``. ``slopes``: one per head of the tensor it was read from (one for a bias
    shared by all heads), exactly as the tensor holds them (fp32 values are exact in a float)."""

    slopes: tuple[float, ...]
    form: DistanceForm
    causal: bool

    def distances(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``δ(i, j)`` for query positions ``q_pos`` [sq] and key positions ``k_pos`` [sk]: [sq, sk] fp32."""
        d = (k_pos[None, :] - q_pos[:, None]).to(torch.float32)
        return d if self.form is DistanceForm.KEY_MINUS_QUERY else -d.abs()

    def scores(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias ``m_h · δ(i, j)`` at these positions, ``[len(slopes), sq, sk]`` fp32 (no mask:
        the causal structure is the caller's). The same fp32 product the model computes, so an
        ``m·(j − i)`` model gets its own values bit for bit."""
        slopes = torch.tensor(self.slopes, dtype=torch.float32, device=q_pos.device)
        return slopes[:, None, None] * self.distances(q_pos, k_pos)[None]


def read_linear_bias(mask: Tensor | None) -> LinearBias | None:
    """The :class:`LinearBias` ``mask`` is, or None when it is not one (see the module docstring).

    ``mask``: a float ``attn_mask`` as given to ``F.scaled_dot_product_attention``, ``[n, n]`` or
    ``[..., H, n, n]`` with every leading slice the same (a batch dim of copies is fine). Context
    parallelism reads every call's mask, so the check runs over blocks of rows of one head at a
    time: its temporaries stay a few ``_CHUNK``-element tensors whatever the mask's size."""
    if mask is None or not isinstance(mask, Tensor) or not mask.is_floating_point() or mask.dim() < 2:
        return None
    if mask.requires_grad or mask.size(-1) != mask.size(-2) or mask.size(-1) < 2:
        return None
    m = mask.detach()
    m = m.reshape(-1, *m.shape[-3:]) if m.dim() >= 3 else m[None, None]
    if m.size(0) > 1 and not bool((m == m[:1]).logical_or(m.isnan() & m[:1].isnan()).all()):
        return None  # leading slices differ (a per-sample mask: padding, documents)
    m = m[0]  # [H, n, n]
    causal = bool(m[0, 0, 1] == float("-inf"))
    forms = (DistanceForm.KEY_MINUS_QUERY,) if causal else tuple(DistanceForm)
    row = 1 if causal else 0  # a row with two kept entries: (1, 0), (1, 1) causal; (0, 0), (0, 1) else
    eps = torch.finfo(mask.dtype).eps
    for form in forms:
        step = m[:, row, 1].double() - m[:, row, 0].double()  # m·δ(row, 1) − m·δ(row, 0)
        slopes = step if form is DistanceForm.KEY_MINUS_QUERY or causal else -step
        candidate = LinearBias(tuple(float(s) for s in slopes.to(mask.dtype)), form, causal)
        if all(_holds(m[h], candidate, h, eps) for h in range(m.size(0))):
            return candidate
    return None


_CHUNK = 1 << 20  # elements of one block of rows the check holds at a time


def _holds(head: Tensor, bias: LinearBias, h: int, eps: float) -> bool:
    """Head ``h``'s ``[n, n]`` slice: ``-inf`` exactly where ``j > i`` (causal) or nowhere, no
    nan or +inf, and every kept entry minus its row's diagonal entry (the per-row constant)
    equal to ``m_h · δ(i, j)`` within ``_ULPS`` units of the row block's largest magnitude."""
    n = head.size(-1)
    pos = torch.arange(n, device=head.device)
    diagonal = head.diagonal().double()
    slope = bias.slopes[h]
    rows = max(1, _CHUNK // n)
    for start in range(0, n, rows):
        block = head[start : start + rows].double()
        i = pos[start : start + rows]
        masked = block == float("-inf")
        above = pos[None, :] > i[:, None]
        if not torch.equal(masked, above if bias.causal else torch.zeros_like(above)):
            return False  # a mask other than the causal one (windows, documents, padding)
        kept = block.masked_fill(masked, 0.0)
        if not bool(kept.isfinite().all()):
            return False  # nan or +inf
        want = slope * bias.distances(i, pos).double()
        error = (kept - diagonal[start : start + rows, None] - want).masked_fill(masked, 0.0).abs()
        if float(error.max()) > _ULPS * eps * (1.0 + float(kept.abs().max())):
            return False
    return True
