"""Proof, before training, that the applied plan computes what the model computes.

After the dimensions are applied, the parallel model runs once on a probe batch and each
piece (embedding, every block, final norm, head) is compared with the unparallelized piece,
rebuilt one at a time from a weightless copy and the full weights gathered from the shards.
See ``docs/model_plans.md`` ("Verifying the applied plan").
"""

from lightning_5d.verify.check import CheckReport, PlanCheck
from lightning_5d.verify.compare import Difference, PieceResult, PlanVerificationError, difference, tolerance_for
from lightning_5d.verify.probe import ProbeError

__all__ = [
    "CheckReport",
    "Difference",
    "PieceResult",
    "PlanCheck",
    "PlanVerificationError",
    "ProbeError",
    "difference",
    "tolerance_for",
]
