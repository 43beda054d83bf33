"""What one rank holds after the cuts: its model built on the meta device and cut as the job would cut it.

For rank ``r`` of a layout: build the model on the meta device (no memory, no init), run the
strategy's own cutting steps on it (``lightning_5d.dimensions``: discover -> tensor ->
expert -> pipeline, in :data:`~lightning_5d.dimensions.STEPS` order, with their checks)
against a :class:`~lightning_5d.dryrun.rank_mesh.RankMesh` for ``r``, and list what is left:
each parameter's shape at this rank next to its unsplit shape. The steps that only change
the forward (context parallelism, activation checkpointing, FP8 linears) and the data step
(ZeRO; it needs a process group) are not run: ZeRO's cut of each tensor is arithmetic on
these shapes (:mod:`lightning_5d.dryrun.state`).

Ranks that hold equally shaped tensors are cut once (:func:`cut_classes`, :class:`CutClasses`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.config import Layout, ParallelConfig
from lightning_5d.dimensions import STEPS, apply_dimensions, rewrites_forward
from lightning_5d.dryrun.rank_mesh import RankMesh
from lightning_5d.layout_rules import Combination
from lightning_5d.materialize.record import func_name
from lightning_5d.plan import ModelMappingError, discover
from lightning_5d.plan.model_plan import ModelPlan

# The steps that decide which tensors a rank holds and at which shape.
CUT_STEPS = tuple(step for step in STEPS if step.name in ("discover", "tensor", "expert", "pipeline"))


class CutClasses(str, Enum):
    """Which ranks are cut separately.

    ``stage``: one cut per pipeline coordinate. tp and ep ranks of a stage hold pieces of the
    same shapes, because the cutting steps refuse any shape that does not divide
    (``validate_tensor_parallel``; ``ExpertParallel``: E % ep), and dp / cp ranks hold the same
    tensors; so the bytes differ only by what ZeRO does, which is per rank anyway.
    ``coordinate``: one cut per (pp, tp, ep) coordinate, which checks that claim (tests).
    """

    STAGE = "stage"
    COORDINATE = "coordinate"


CLASS_DIMS = {CutClasses.STAGE: ("pp",), CutClasses.COORDINATE: ("pp", "tp", "ep")}


class Part:
    EMBEDDING, BLOCKS, FINAL_NORM, HEAD, OTHER = "embedding", "blocks", "final_norm", "head", "other"


@dataclass(frozen=True)
class HeldTensor:
    """One parameter on one rank: ``shape`` at this rank (after tp/ep/pp), ``full`` unsplit."""

    name: str
    shape: tuple[int, ...]
    full: tuple[int, ...]
    itemsize: int  # as built (what the replay recomputes in)
    expert: bool  # a routed expert's (ZeRO shards it over edp, not dp x cp)
    part: str  # Part.*
    trainable: bool = True  # requires_grad as built: a frozen one has no gradient or optimizer state

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def full_numel(self) -> int:
        return _numel(self.full)

    @property
    def cut(self) -> bool:
        return self.shape != self.full


@dataclass(frozen=True)
class RankCut:
    """What the ranks of one cut class hold."""

    coords: dict[str, int]  # the class's coordinates (CLASS_DIMS)
    ranks: tuple[int, ...]
    tensors: tuple[HeldTensor, ...]
    blocks: int  # transformer blocks held

    def parts(self) -> set[str]:
        return {t.part for t in self.tensors}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@contextmanager
def quiet_rank_zero() -> Iterator[None]:
    """The steps log their plan per rank through Lightning's rank-zero logger; a dry run cuts many ranks."""
    from lightning_utilities.core import rank_zero

    logger = rank_zero.log
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _part(name: str, plan: ModelPlan | None) -> str:
    if plan is None:  # a layout that needs no plan, of a model discovery cannot map (Unsplit.of)
        return Part.OTHER

    def under(path: str | None) -> bool:
        return bool(path) and (name == path or name.startswith(path + "."))

    if under(plan.blocks):
        return Part.BLOCKS
    if under(plan.embedding) or under(plan.position_embedding):
        return Part.EMBEDDING
    if under(plan.final_norm):
        return Part.FINAL_NORM
    if under(plan.head):
        return Part.HEAD
    return Part.OTHER


def _block_index(name: str, plan: ModelPlan | None) -> str | None:
    if plan is None or not name.startswith(plan.blocks + "."):
        return None
    return name[len(plan.blocks) + 1 :].split(".", 1)[0]


# In-place calls that only write values: on a meta tensor they change nothing a dry run reads
# (shape, dtype, requires_grad), but torch still runs their reference decomposition (a 405B
# model's init_weights takes seconds of it).
_VALUE_WRITES = frozenset({"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_",
                           "log_normal_", "cauchy_", "fill_", "zero_", "copy_", "mul_", "div_", "add_", "sub_",
                           "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "addcmul_", "addcdiv_", "lerp_",
                           "masked_fill_", "index_fill_", "__setitem__"})  # fmt: skip


class ShapesOnly(TorchFunctionMode):
    """Skip value-only in-place writes on meta tensors (they are no-ops there anyway)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if isinstance(first, Tensor) and first.is_meta and func_name(func) in _VALUE_WRITES:
            return first
        return func(*args, **kwargs)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"), ShapesOnly():
        module = build()
    real = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta]
    if real:
        raise ValueError(
            f"the model builder made real tensors under torch.device('meta') ({real[:3]}); a dry run must build "
            f"without memory: create tensors without an explicit device=, as the model would under "
            f"trainer.init_module(empty_init=True)."
        )
    return module


@dataclass(frozen=True)
class Unsplit:
    """The whole model's plan and parameter shapes (one discovery serves every rank)."""

    plan: ModelPlan | None  # None: the layout needs no plan and discovery could not map the model
    shapes: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, build: Callable[[], nn.Module], config: ParallelConfig, needs_plan: bool = True) -> "Unsplit":
        """``needs_plan``: a dimension of the layout reads the plan. Without one (data parallelism alone)
        a model discovery cannot map (adapter wrappers, say) is still counted, without its parts."""
        module = on_meta(build)
        with quiet_rank_zero():
            try:
                plan = discover(module, config.model_plan)
            except ModelMappingError:
                if needs_plan:
                    raise
                plan = None
        return cls(plan, {n: tuple(p.shape) for n, p in module.named_parameters()})


def cut_rank(
    build: Callable[[], nn.Module], config: ParallelConfig, layout: Layout, combination: Combination, rank: int,
    unsplit: Unsplit | None = None,
) -> tuple[list[HeldTensor], int]:  # fmt: skip
    """Rank ``rank``'s tensors after the cutting steps, and how many blocks it holds."""
    unsplit = unsplit or Unsplit.of(build, config)
    plan, full = unsplit.plan, unsplit.shapes
    module = on_meta(build)
    with quiet_rank_zero():
        applied = apply_dimensions(module, config, RankMesh(layout, rank), None, combination, steps=CUT_STEPS)
    is_expert = applied.ep.is_expert if applied.ep is not None else (lambda name: False)
    tensors = [
        HeldTensor(n, tuple(p.shape), full[n], p.element_size(), is_expert(n), _part(n, plan), p.requires_grad)
        for n, p in module.named_parameters()  # unique: a tied weight is held once
    ]
    blocks = {b for t in tensors if (b := _block_index(t.name, plan)) is not None}
    return tensors, len(blocks)


def cut_classes(
    build: Callable[[], nn.Module], config: ParallelConfig, layout: Layout, combination: Combination,
    classes: CutClasses = CutClasses.STAGE, plan_needed: bool | None = None,
) -> list[RankCut]:  # fmt: skip
    """One :class:`RankCut` per class of ranks (:class:`CutClasses`), with every rank it covers.

    ``plan_needed``: whether the job's steps read the plan, as :func:`rewrites_forward` answers
    with the job's precision plugin (FP8 rewrites the linears); None: decided here without one.
    """
    dims = CLASS_DIMS[CutClasses(classes)]
    members: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        mesh = RankMesh(layout, rank)
        key = tuple(mesh.local_rank(d) if d != "ep" or layout.ep > 1 else 0 for d in dims)
        members.setdefault(key, []).append(rank)
    if plan_needed is None:
        plan_needed = rewrites_forward(config, RankMesh(layout, 0), None, combination)
    unsplit = Unsplit.of(build, config, plan_needed)
    cuts = []
    for key, ranks in members.items():
        tensors, blocks = cut_rank(build, config, layout, combination, ranks[0], unsplit)
        cuts.append(RankCut(dict(zip(dims, key)), tuple(ranks), tuple(tensors), blocks))
    return cuts
