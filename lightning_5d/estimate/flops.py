"""Training FLOPs: model FLOPs (what MFU divides by) and hardware FLOPs (recompute included, HFU).

Per token, forward: ``2 * N_matmul`` for the weight matmuls (N_matmul: the weights a token
multiplies with, output head included, embedding lookup excluded; MoE: only the k routed
experts) plus ``4 * s * a*d`` per layer for QK^T and AV. Backward costs twice the forward,
so training is ``6*N_matmul + 12*L*s*h`` per token (h = a*d) - the ``6N + 12Lhs`` rule.
Attention is counted without the causal mask's halving, as Korthikanti et al. and the
playbook do, so MFU numbers compare with theirs.

Recompute adds work on top (hardware FLOPs): full recompute repeats every layer's forward
(not the head's); selective repeats the attention-core forward (the QK^T and AV matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_5d.config import ActivationCheckpointing

from .params import ParamCounts, count_params
from .spec import ModelSpec
from .training import TrainingSetup


@dataclass(frozen=True)
class FlopsEstimate:
    model_per_token: float  # 6*N_matmul + 12*L*s*h
    hardware_per_token: float  # model + recomputation
    tokens_per_step: int
    attention_per_token: float  # the 12*L*s*h part (what cp's ring can overlap with)

    @property
    def model_per_step(self) -> float:
        return self.model_per_token * self.tokens_per_step

    @property
    def hardware_per_step(self) -> float:
        return self.hardware_per_token * self.tokens_per_step


def forward_flops_per_token(
    spec: ModelSpec, seq_len: int, counts: ParamCounts | None = None
) -> tuple[float, float]:
    """(weight-matmul FLOPs, attention-core FLOPs) of one token's forward pass."""
    counts = counts or count_params(spec)
    return 2.0 * counts.matmul_active, 4.0 * spec.num_layers * seq_len * spec.q_width


def training_flops(spec: ModelSpec, setup: TrainingSetup, counts: ParamCounts | None = None) -> FlopsEstimate:
    counts = counts or count_params(spec)
    matmul, attention = forward_flops_per_token(spec, setup.seq_len, counts)
    model = 3 * (matmul + attention)
    if setup.recompute == ActivationCheckpointing.FULL:
        recomputed = matmul - 2.0 * counts.vocab_hidden + attention  # every layer again, not the head
    elif setup.recompute == ActivationCheckpointing.SELECTIVE:
        recomputed = attention
    else:
        recomputed = 0.0
    return FlopsEstimate(
        model_per_token=model,
        hardware_per_token=model + recomputed,
        tokens_per_step=setup.tokens_per_step,
        attention_per_token=3 * attention,
    )


def utilization(flops_per_step: float, step_time_s: float, num_gpus: int, peak_flops_per_gpu: float) -> float:
    """Achieved / peak: MFU with model FLOPs, HFU with hardware FLOPs."""
    if step_time_s <= 0 or num_gpus < 1 or peak_flops_per_gpu <= 0:
        raise ValueError(
            f"step_time_s={step_time_s}, num_gpus={num_gpus}, peak_flops_per_gpu={peak_flops_per_gpu} must be positive."
        )
    return flops_per_step / (step_time_s * num_gpus * peak_flops_per_gpu)
