"""Model discovery: where the embedding, blocks, attention, MLP, MoE and head of a model are.

``discover(module, explicit=None)`` returns a :class:`ModelPlan` that every parallel
dimension reads; ``describe`` prints it as a table.
"""

from lightning_5d.plan.blocks import ModelMappingError, find_blocks, require_blocks
from lightning_5d.plan.describe import describe
from lightning_5d.plan.discover import discover
from lightning_5d.plan.model_plan import (
    AttentionKernel,
    AttentionPlan,
    BlockPlan,
    ExpertsKind,
    MLPPlan,
    ModelPlan,
    MoEPlan,
    PlanSource,
    Projection,
    ProjectionKind,
)
from lightning_5d.plan.roles import PlanConflictError, Role

__all__ = [
    "AttentionKernel",
    "AttentionPlan",
    "BlockPlan",
    "ExpertsKind",
    "MLPPlan",
    "MoEPlan",
    "ModelMappingError",
    "ModelPlan",
    "PlanConflictError",
    "PlanSource",
    "Projection",
    "ProjectionKind",
    "Role",
    "describe",
    "discover",
    "find_blocks",
    "require_blocks",
]
