"""Whether pp can cut a model into stages, checked before any stage is made: an output head to
end the last stage, blocks with a forward to hook each boundary on, and every parameter outside
the parts placed by when the probe forward read it (first stage: before the first block; last
stage: after the last)."""

from __future__ import annotations

from torch import nn

from lightning_5d.plan import paths
from lightning_5d.plan.model_plan import LooseParam, ModelPlan, Phase

from .batch import PipelineError


def check_cuttable(module: nn.Module, plan: ModelPlan) -> tuple[list[str], list[str]]:
    """Refuse, before any stage is made, a model pp cannot cut; return the loose parameters the
    first and the last stage hold (:func:`loose_by_stage`)."""
    if plan.head is None:
        raise PipelineError("the model plan has no output head; pp needs one to know where the last stage ends.")
    bare = [i for i, b in enumerate(plan.blocks_of(module)) if isinstance(b, (nn.ModuleList, nn.ModuleDict))]
    if bare:
        # A stage boundary is a hook on a block's forward; a container the model iterates has none.
        raise PipelineError(
            f"the blocks of {plan.blocks} are {type(plan.blocks_of(module)[bare[0]]).__name__}s with no forward of "
            f"their own, so no pipeline stage boundary can be hooked between them. Give each block a module with a "
            f"forward (e.g. `class Block(nn.Module)` calling its attention and MLP), or use pp=1."
        )
    return loose_by_stage(module, plan)


def loose_by_stage(module: nn.Module, plan: ModelPlan) -> tuple[list[str], list[str]]:
    """Parameters outside the parts that the first / the last stage holds: those the probe saw
    read only before the first block (with the embedding) / only after the last one (with the
    head). Any other one is refused, with when it was read."""
    known = [plan.blocks, *(p for p in (plan.embedding, plan.position_embedding, plan.final_norm, plan.head) if p)]
    stray = [
        name for name, _ in module.named_parameters() if not any(paths.is_within(name, k) for k in known)
    ]
    observed = {p.name: p for p in plan.loose_params}
    first = [n for n in stray if n in observed and observed[n].phase is Phase.BEFORE]
    last = [n for n in stray if n in observed and observed[n].phase is Phase.AFTER]
    left = [n for n in stray if n not in first + last]
    if left:
        raise PipelineError(
            "parameters outside the blocks, embedding, final norm and head cannot be placed on a pipeline stage: "
            f"{', '.join(_when_read(n, observed.get(n)) for n in left[:5])}. A pipeline stage holds whole blocks, "
            f"and the first stage also what the forward reads before the first block, the last stage what it reads "
            f"after the last block; move each of these into a block (or into the embedding / head module), or use pp=1."
        )
    return first, last


def _when_read(name: str, loose: LooseParam | None) -> str:
    if loose is None:
        return f"{name} (not observed: the probe forward did not run)"
    if not loose.phases:
        return f"{name} (never read by the probe forward)"
    return f"{name} (read {' and '.join(p.value for p in Phase if p in loose.phases)})"
