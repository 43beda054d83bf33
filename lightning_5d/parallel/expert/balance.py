"""Load balancing for token-choice routers: the auxiliary loss and the aux-loss-free bias.

Auxiliary loss (Switch Transformer eq. 4, GShard): ``E * sum_e f_e * P_e`` with f_e the
fraction of assignments routed to expert e and P_e the mean router probability of e.
f_e counts the whole data-parallel batch (its counts are summed over dp x cp, as in
Megatron's "global" aux loss): with P_e local, the mean of the ranks' gradients is then
the gradient of the one-process loss on the whole batch.

The loss reaches the gradient without touching the user's ``training_step``: the MoE
output carries it through :class:`AttachAuxLoss`, whose backward hands the aux term the
gradient the total loss would give it (Megatron's MoEAuxLossAutoScaler does the same).

Aux-loss-free balancing (DeepSeek-V3, section 2.1.2): a per-expert bias added to the
scores for top-k selection only; after each optimizer step it moves by ``rate`` towards
the under-loaded experts: ``b_e += rate * sign(mean load - load_e)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def load_balancing_loss(probs: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """``E * sum_e f_e * P_e``; ``probs`` [T, E] (fp32, with grad), counts [E] (no grad). 1.0 when balanced."""
    num_experts = probs.shape[-1]
    f = tokens_per_expert.to(probs.dtype) / tokens_per_expert.sum().clamp(min=1)
    return num_experts * (f * probs.mean(0)).sum()


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux`` gets gradient ``scale`` (d total / d aux)."""

    @staticmethod
    def forward(ctx, output: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def update_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> None:
    """DeepSeek-V3's update, in place; ``tokens_per_expert`` must be the same on every rank."""
    load = tokens_per_expert.to(bias.dtype)
    bias.add_(rate * torch.sign(load.mean() - load))
