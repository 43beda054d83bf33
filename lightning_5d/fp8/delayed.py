"""Amax histories for delayed scaling.

Delayed scaling (Transformer Engine's ``DelayedScaling``) quantizes a tensor with a scale taken from
the largest amax seen over the last ``history_len`` steps instead of the tensor's own amax. On a GPU
that removes a reduction (and its synchronization) from the critical path before the cast; the price
is that a value larger than anything in the history saturates at the format's max.

Each Fp8Linear keeps one history per GEMM operand role (input, weight, grad_output) as a buffer,
so the histories follow the module across devices. They advance once per optimizer step, not per
forward: every forward and backward of a step (its micro-batches, pipeline stages in flight, and
the activation-checkpoint recompute, which must quantize exactly as the forward did) scales from
the same history, and the step's largest amax per role waits in a pending buffer until
``advance_amax_histories`` pushes it. The buffers are not in the module's ``state_dict`` (a
checkpoint of an FP8 run must load into the same model in bf16); ``FiveDPrecision.state_dict``
carries them instead, so a resumed run scales its first step as the uninterrupted run would.

Everything here stays on the device as tensors (no ``.item()``), so updating a history never
synchronizes with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

DEFAULT_AMAX_HISTORY_LEN = 16
ROLES = ("input", "weight", "grad_output")


def history_buffer_name(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown amax history role {role!r}; expected one of {ROLES}")
    return f"amax_history_{role}"


def pending_buffer_name(role: str) -> str:
    return f"{history_buffer_name(role)}_pending"


def register_amax_histories(module: nn.Module, history_len: int, device: torch.device | None = None) -> None:
    """Give ``module`` one zeroed fp32 history of ``history_len`` entries per role, and the pending
    amax of the current step (non-persistent buffers, see the module docstring)."""
    if int(history_len) < 1:
        raise ValueError(f"amax_history_len must be at least 1, got {history_len}")
    for role in ROLES:
        module.register_buffer(
            history_buffer_name(role),
            torch.zeros(int(history_len), dtype=torch.float32, device=device),
            persistent=False,
        )
        module.register_buffer(
            pending_buffer_name(role), torch.zeros((), dtype=torch.float32, device=device), persistent=False
        )


def amax_histories(module: nn.Module) -> dict[str, Tensor]:
    """The module's histories by role (empty if it has none, i.e. its recipe is not delayed)."""
    out = {}
    for role in ROLES:
        buf = getattr(module, history_buffer_name(role), None)
        if isinstance(buf, Tensor):
            out[role] = buf
    return out


def scaling_amax(history: Tensor, current_amax: Tensor) -> Tensor:
    """The amax to scale this step with: the max over earlier steps, or, while the history is still
    all zero (the first step, or a tensor that has only ever been zero), the current amax, since a
    zero history carries no information and scaling from it would saturate everything."""
    past = history.max()
    return torch.where(past > 0, past, current_amax.to(past.dtype))


def push_amax(history: Tensor, amax: Tensor) -> None:
    """Record ``amax`` as the newest entry (index 0), dropping the oldest (in place)."""
    with torch.no_grad():
        history.copy_(torch.roll(history, 1))
        history[0] = amax.detach().to(history.dtype)


def record_amax(module: nn.Module, role: str, amax: Tensor) -> None:
    """Keep the largest amax of ``role`` seen during this optimizer step (pushed at its end)."""
    pending = getattr(module, pending_buffer_name(role))
    with torch.no_grad():
        torch.maximum(pending, amax.detach().to(pending.dtype), out=pending)


def advance_amax_histories(module: nn.Module) -> None:
    """End of an optimizer step: push each role's pending amax into its history and restart it.
    A role that recorded nothing this step (eval only, or the module did not run) is left alone."""
    for role, history in amax_histories(module).items():
        pending = getattr(module, pending_buffer_name(role))
        with torch.no_grad():
            pushed = torch.cat([pending.reshape(1), history[:-1]])
            history.copy_(torch.where(pending > 0, pushed, history))
            pending.zero_()
