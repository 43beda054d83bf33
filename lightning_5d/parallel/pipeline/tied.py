"""Tied input/output embeddings under pp: Megatron's embedding group.

The head's weight *is* the embedding's. The first stage's rank and the last stage's rank each
hold it (the same initial values: every rank starts from rank 0's), registered under both names
as one process has them (on the rank without the real embedding or head, that part's
placeholder holds it), so state dicts, optimizer states and checkpoints name it as one process
does. After each pipeline run the two copies' gradients are summed over the pair {first stage's
rank, last stage's rank} of each pipe, and both take the same optimizer step. When one rank holds
both stages it holds one parameter and nothing travels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_5d.config import PipelineSchedule
from lightning_5d.mesh import ParallelMesh
from lightning_5d.pipeline_shape import V_SHAPED
from lightning_5d.plan.model_plan import ModelPlan

from .batch import PipelineError


def tied_names(embedding: nn.Module, head: nn.Module) -> list[tuple[str, str]]:
    """(embedding's name, head's name) of each parameter the two share, observed by identity.

    Only parameters held directly: a placeholder stands in for the whole part and can hold
    them under the same names."""
    heads = {id(p): n for n, p in head.named_parameters(recurse=False)}
    tied = [(n, heads[id(p)]) for n, p in embedding.named_parameters(recurse=False) if id(p) in heads]
    deep = {id(p) for _, p in head.named_parameters()} & {id(p) for _, p in embedding.named_parameters()}
    if len(deep) != len(tied):
        raise PipelineError(
            f"the embedding ({type(embedding).__name__}) and the head ({type(head).__name__}) share a parameter "
            f"inside a submodule; pp can tie only parameters the two modules hold directly (e.g. head.weight is "
            f"embedding.weight). Tie those, untie the others, or use pp=1."
        )
    return tied


def check_tied_schedule(tied: list, schedule: PipelineSchedule, plan: ModelPlan) -> None:
    """A V schedule runs the first and the last stage on one rank with split backward passes
    (input, then weight gradients per stage); a weight both stages use then gets a wrong
    gradient from torch's per-stage weight pass, so such layouts are refused."""
    if tied and schedule in V_SHAPED:
        raise PipelineError(
            f"{plan.head}.weight is {plan.embedding}.weight (tied embeddings) and pipeline.schedule="
            f"{schedule.value} runs the first and the last stage on one rank with split weight-gradient passes, "
            f"which torch's pipelining computes per stage, wrongly for a weight both stages use. Use "
            f"pipeline.schedule=interleaved_1f1b (or 1f1b, zero_bubble): they tie the embedding across ranks."
        )


class TiedEmbedding:
    """The tied weights of one pipeline rank: which names, the pair group, the gradient sum."""

    def __init__(self, names: list[tuple[str, str]], plan: ModelPlan, owner: list[int], rank: int) -> None:
        self.names = names
        self.plan = plan
        self.first, self.last = owner[0], owner[-1]
        self.rank = rank
        # The pair of ranks summing the tied weight's gradient (None: one rank holds both ends, or none).
        self.group: dist.ProcessGroup | None = None

    def hold_copy(self, real: dict[str, nn.Module], placeholders: dict[str, nn.Module], first: bool,
                  last: bool) -> None:  # fmt: skip
        """On a rank with only one end of the pipe, the other end's placeholder holds the tied
        weight too, under its own name: the module then names it as one process does."""
        if not self.names or first == last:
            return
        plan = self.plan
        mine_path, other_path = (plan.embedding, plan.head) if first else (plan.head, plan.embedding)
        for emb_name, head_name in self.names:
            mine, theirs = (emb_name, head_name) if first else (head_name, emb_name)
            placeholders[other_path].register_parameter(theirs, real[mine_path].get_parameter(mine))

    def join_pair_group(self, mesh: ParallelMesh, pp_group: dist.ProcessGroup, pp: int) -> None:
        """Collective over the world at pp > 2: every rank creates every pair's group."""
        if not self.names or self.first == self.last:
            return  # a V schedule: the first and the last stage share a rank, and the parameter
        if pp == 2:
            self.group = pp_group
            return
        group = mesh.pipe_pair_group(self.first, self.last)
        self.group = group if self.rank in (self.first, self.last) else None

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The tied weights as this rank holds them now (FSDP2 replaces the parameter objects)."""
        if self.group is None:
            return []
        return [module.get_submodule(self.plan.embedding).get_parameter(e) for e, _ in self.names]

    def sum_gradients(self, module: nn.Module) -> None:
        """After a pipeline run: the embedding's and the head's gradients of the tied weight, summed
        on both ranks (collective over the pair; under ZeRO-3, of the two copies' identical shards)."""
        for p in self.parameters(module):
            if p.grad is None:  # a step that did not use one end: it still takes part with zeros
                p.grad = torch.zeros_like(p)
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=self.group)

    def counts_elsewhere(self, name: str) -> bool:
        """Whether ``name`` is this rank's copy of a tied weight whose norm the first stage's rank counts."""
        if self.group is None or self.rank == self.first:
            return False
        return any(name in (f"{self.plan.embedding}.{e}", f"{self.plan.head}.{h}") for e, h in self.names)
