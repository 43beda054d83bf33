"""One backward per piece on both sides: the parameter gradients the verifier compares.

The forward comparison cannot see a plan whose error is in gradients only: a replicated
parameter that sees only this rank's heads (a per-head q/k norm under tp) or sequence shard
(a norm under SP, every parameter under cp) gets this rank's part of its gradient, and
training then needs the sum over those ranks. So each piece also runs one backward:

    parallel:   g_par = d<c(y_par), y_par>/dθ_local   (torch.autograd.grad from the probe's graph),
                then the sums training applies: tp's partial-gradient hooks (they fire inside
                autograd.grad), the sum over cp (each cp rank saw its chunk of the sequence),
                then tp's gather of a cut parameter to its full shape
    reference:  g_ref = d<c(y_ref), y_ref>/dθ        (the unparallelized piece, fp32)

``c`` is the cotangent: a fixed elementwise function of the output (``cos(3y) + 1/2``). An
elementwise function is cut exactly as the output is (sequence shards, vocabulary shards,
head columns), so every rank holds its slice of one global cotangent without knowing how
its layout cuts the output, and both sides use the same cotangent up to the forward's own
(already checked) difference. Gradients are taken only along paths to the piece's own
parameters, so no earlier piece runs a backward (and no earlier collective fires).

Not under ZeRO-3: FSDP2 owns the unsharded parameters the forward used (its sharded
``DTensor`` parameters are not in the graph); those pieces are compared on outputs only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def cotangent(y: Tensor) -> Tensor:
    """The cotangent of a piece's output ``y`` (elementwise in ``y``; see the module docstring)."""
    return (torch.cos(3.0 * y.detach().float()) + 0.5).to(y.dtype)


def _local(y: Any) -> Tensor | None:
    if isinstance(y, DTensor):
        return y.to_local()
    return y if isinstance(y, Tensor) else None


def _grads(output: Tensor | None, params: list[nn.Parameter], retain: bool) -> list[Tensor]:
    if output is None or not output.requires_grad or not params:
        return [torch.zeros_like(p) for p in params]
    found = torch.autograd.grad(output, params, grad_outputs=cotangent(output), allow_unused=True, retain_graph=retain)
    return [torch.zeros_like(p) if g is None else g.detach().clone() for p, g in zip(params, found)]


def trainable_names(module: nn.Module) -> list[str]:
    """The parameters a piece trains (each tensor once), by name relative to the piece."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def parallel_grads(live: nn.Module, prefix: str, names: list[str], output: Any, tp: Any | None,
                   cp: Any | None) -> dict[str, Tensor]:  # fmt: skip
    """``names``' gradients of the live piece at full shape, summed as training sums them.

    A collective over cp and tp: every rank holding this piece calls it in the same order."""
    params = dict(live.named_parameters())
    grads = _grads(_local(output), [params[n] for n in names], retain=True)
    out = {}
    for name, grad in zip(names, grads):
        if cp is not None:  # each cp rank saw its chunk of the sequence; training sums them over dp x cp
            dist.all_reduce(grad, group=cp.group)
        full_name = f"{prefix}.{name}" if prefix else name
        if tp is not None and tp.is_sharded(full_name):
            grad = tp.full_state({full_name: grad})[full_name]
        out[name] = grad
    return out


def reference_grads(reference: nn.Module, names: list[str], output: Any) -> dict[str, Tensor]:
    params = dict(reference.named_parameters())
    return dict(zip(names, _grads(_local(output), [params[n] for n in names], retain=False)))


def has_dtensor_parameters(live: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in live.parameters())
