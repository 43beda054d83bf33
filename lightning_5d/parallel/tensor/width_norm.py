"""Norms over a projection's full output width (OLMo-2's q/k RMSNorm) under tensor parallelism.

A q/k norm applied per head (Qwen3) sees whole heads on every rank and stays replicated. A
norm over the whole projection width (OLMo-2: ``q_norm(q_proj(x))`` with a weight of
``H·d`` features) needs statistics over columns that tp spreads over its ranks. For an
RMSNorm the only such statistic is the sum of squares, so the distributed norm is

    ss_r   = Σ_{j on rank r} x_j²                 (local)
    ss     = Σ_r ss_r                              (all-reduce over tp; backward: all-reduce)
    y_j    = w_j · x_j / sqrt(ss / N + ε)          (N = the full width; w cut like x's columns)

and no activation is gathered. The all-reduce's backward sums too: every rank's output
columns depend on ``ss``, so its gradient is the sum of each rank's part. The weight is cut
along its features exactly like the projection's output columns, so each rank's weight
gradient is complete (no tp sum).

Which modules: children of the attention module holding a 1-D ``weight`` whose size is the
full width of the q or k projection (not the head dim: that is a per-head norm). That
their forward is an RMSNorm is checked on a random input against the formula above
(with the module's own epsilon); a norm of another form (a LayerNorm subtracts a mean over
the width too) is refused. The plan verifier then compares the block with the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_5d.parallel.tensor import ops as tensor_ops
from lightning_5d.plan import paths

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


@dataclass(frozen=True)
class WidthNorm:
    """A norm inside an attention module over the full output width of one of its projections."""

    path: str  # relative to the block
    width: int  # the full width (its weight's size)
    eps: float | None  # None: not an RMSNorm (the module's forward computes something else)


def _eps_of(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _rms(x: Tensor, weight: Tensor, eps: float, sum_of_squares: Tensor, width: int) -> Tensor:
    y = x.float() * torch.rsqrt(sum_of_squares / width + eps)
    return (weight * y).to(x.dtype)


def _is_rms_norm(module: nn.Module, eps: float | None) -> bool:
    """Whether ``module``'s own forward is ``w · x / sqrt(mean(x²) + eps)`` (checked on a random input)."""
    if eps is None:
        return False
    weight = module.weight
    if weight.is_meta:  # built on the meta device: nothing to run; the plan verifier proves it later
        return "rms" in type(module).__name__.lower()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.numel(), generator=generator, dtype=torch.float32).to(weight.device)
    with torch.no_grad():
        try:
            got = module(x)
        except Exception:  # noqa: BLE001 - a forward that cannot take [rows, width] is not a plain norm
            return False
        want = _rms(x, weight.detach().float(), eps, x.pow(2).sum(-1, keepdim=True), x.size(-1))
    return isinstance(got, Tensor) and got.shape == want.shape and bool(torch.allclose(got.float(), want, rtol=1e-5, atol=1e-6))


def find_width_norms(
    block: nn.Module, attention_path: str, widths: set[int], head_dim: int, pre_norms: tuple[str, ...] = ()
) -> list[WidthNorm]:
    """The width norms inside ``block``'s attention module (``widths``: full q and k widths).

    ``pre_norms``: the block's norms (paths relative to the block) on the attention's or
    MLP's input; one held inside the attention module normalizes the hidden state, which tp
    leaves whole, even when the hidden size equals the q width."""
    attention = block.get_submodule(attention_path)
    found = []
    for name, module in attention.named_modules():
        weight = getattr(module, "weight", None)
        if not name or list(module.children()) or not isinstance(weight, Tensor) or weight.dim() != 1:
            continue
        if paths.join(attention_path, name) in pre_norms:
            continue
        if weight.numel() == head_dim or weight.numel() not in widths:
            continue
        eps = _eps_of(module)
        found.append(WidthNorm(f"{attention_path}.{name}", weight.numel(), eps if _is_rms_norm(module, eps) else None))
    return found


def distributed_rms_forward(module: nn.Module, norm: WidthNorm, group: dist.ProcessGroup):
    """The forward of a width RMSNorm whose input and weight hold this rank's columns."""
    eps, width = norm.eps, norm.width

    def forward(x: Tensor) -> Tensor:
        local = x.float().pow(2).sum(-1, keepdim=True)
        return _rms(x, module.weight, eps, tensor_ops.sum_over_tp(local, group), width)

    return forward
