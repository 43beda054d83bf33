"""Closed-form formulas exactly as the papers print them.

They describe one model family (GPT-style: GeLU MLP of 4h, multi-head attention, dropout)
and serve as cross-checks: the general, shape-aware code in params/flops/memory must give
the same numbers for that family (see the tests).

KOR: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models".
NAR: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters".
"""

from __future__ import annotations

from lightning_5d.config import ActivationCheckpointing


def kor_layer_activation_bytes(
    s: float,
    b: float,
    h: float,
    a: float,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: ActivationCheckpointing = ActivationCheckpointing.NONE,
) -> float:
    """KOR Table 2, bytes per layer with 16-bit activations.

    none ``sbh(34 + 5as/h)``; TP ``sbh(10 + 24/t + 5as/(ht))``; TP+SP ``sbh(34/t + 5as/(ht))``;
    selective drops the ``5as/h`` term; full recompute ``2sbh``.
    """
    recompute = ActivationCheckpointing(recompute)
    sbh = s * b * h
    if recompute == ActivationCheckpointing.FULL:
        return 2 * sbh
    scores = 0.0 if recompute == ActivationCheckpointing.SELECTIVE else 5 * a * s / (h * t)
    outside = 10 / t if sequence_parallel else 10
    return sbh * (outside + 24 / t + scores)


def kor_model_flops(B: float, L: float, s: float, h: float, V: float) -> float:
    """KOR model FLOPs per iteration: ``72*B*L*s*h^2 * (1 + s/(6h) + V/(12hL))``."""
    return 72 * B * L * s * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


def kor_hardware_flops_selective(B: float, L: float, s: float, h: float, V: float) -> float:
    """KOR hardware FLOPs with selective recompute: ``72*B*L*s*h^2 * (1 + s/(3h) + V/(12hL))``.

    This is the formula behind KOR's published HFU numbers. It doubles the attention-core
    term; re-running the attention forward alone would add only a third of it, which is what
    ``flops.training_flops`` counts.
    """
    return 72 * B * L * s * h**2 * (1 + s / (3 * h) + V / (12 * h * L))


def kor_hardware_flops_full(B: float, L: float, s: float, h: float, V: float) -> float:
    """KOR hardware FLOPs with full recompute: ``96*B*L*s*h^2 * (1 + s/(6h) + V/(16hL))``."""
    return 96 * B * L * s * h**2 * (1 + s / (6 * h) + V / (16 * h * L))


def nar_param_count(l: float, h: float, V: float, s: float) -> float:
    """NAR's GPT parameter count ``12*l*h^2 * (1 + 13/(12h) + (V+s)/(12*l*h))`` (final norm left out)."""
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
