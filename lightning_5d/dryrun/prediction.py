"""The planner's numbers for one class of ranks, to put next to what the dry run counted.

The planner (``lightning_5d.estimate``) models a rank as the first or the last pipeline stage
with ``L/p`` equal layers. A dry-run class holds a known number of blocks and knows whether
it holds the embedding and the head, so it is compared with the planner's own per-layer and
per-part parameter counts (``estimate.params.rank_params``) for exactly those pieces, through
the planner's state formula (``estimate.memory.rank_model_state_bytes``, ``RUNTIME``
accounting). What is left between the two is then what the planner approximates (ceil
chunks of ZeRO's slices, kv heads replicated over tp) and nothing else.

Activations and transient buffers come from the planner alone (a dry run allocates nothing):
its first stage for a rank holding the embedding or a middle stage (most microbatches in
flight), its last stage for a rank holding the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_5d.accounting import ModelStateBytes
from lightning_5d.estimate.memory import rank_model_state_bytes, stage_memory
from lightning_5d.estimate.params import RankParams, Stage, count_params, rank_params
from lightning_5d.estimate.spec import ModelSpec
from lightning_5d.estimate.training import TrainingSetup


@dataclass(frozen=True)
class Prediction:
    states: ModelStateBytes  # the planner's params / grads / optimizer for this class's pieces
    activations: float  # the planner's activations for this class's stage (modelled layers)
    buffers: float  # the planner's transient buffers (ZeRO-3 gathers, gradient buckets, cp)
    stage: Stage


def predict(spec: ModelSpec, setup: TrainingSetup, blocks: int, first: bool, last: bool,
            modelled: ModelSpec | None = None) -> Prediction:  # fmt: skip
    """``blocks``: blocks the class holds; ``first`` / ``last``: it holds the embedding / the head.
    ``modelled``: the spec the recipe check models activations with (uneven stages); default ``spec``."""
    counts = count_params(spec)
    one = rank_params(spec, setup, Stage.FIRST, counts)  # for its per-layer counts
    t = setup.tp
    dense = blocks * one.layer_dense
    if first:
        dense += counts.embedding // t
    if last:
        dense += counts.final_norm + counts.head // t
        if spec.tie_embeddings and setup.pp > 1:
            dense += counts.vocab_hidden // t
    held = RankParams(dense=dense, expert=blocks * one.layer_expert, layers=blocks, layer_dense=one.layer_dense,
                      layer_expert=one.layer_expert)  # fmt: skip
    stage = Stage.LAST if last and not first else Stage.FIRST
    memory = stage_memory(modelled or spec, setup, stage)
    return Prediction(rank_model_state_bytes(spec, setup, held), memory.activations, memory.buffers, stage)
