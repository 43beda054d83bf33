"""ZeRO-3: parameters, gradients and optimizer states sharded with FSDP2 ``fully_shard``.

One FSDP unit per transformer block (so at most one block's parameters are gathered at a
time; a block that is a bare ``nn.ModuleList`` is its children, gathered together), one per
token embedding, one for the final norm and head (``_outer_units``), and the root for whatever
is left: the lowest common ancestor of the parameters outside the blocks. A head tied to the
embedding stays with it in the root (one unit holds a shared parameter). So the largest
gathered unit is a block or one V x h matrix, never the embedding and head together, which
bounds every step's peak, the plan verifier's probe included. When that ancestor is the
LightningModule itself (embedding, norm and head as its own attributes), Lightning calls
``training_step``, not ``forward``, so FSDP's forward hooks on it would never unshard the
parameters left there: the strategy then routes each step through the module's forward (see
``AppliedDimensions.run_step``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_5d.config import ZeroStage
from lightning_5d.layout_rules import Combination, hsdp_zero3_cp
from lightning_5d.mesh import ParallelMesh
from lightning_5d.parallel.data.gather_in_place import gather_in_place
from lightning_5d.plan.blocks import ModelMappingError


def fsdp_mesh(mesh: ParallelMesh):
    # HSDP: replicate over dp_replicate, shard over dp_shard x cp.
    if mesh.size("dp_replicate") > 1:
        return mesh[("dp_replicate", "dp_shard")] if mesh.size("cp") == 1 else _hsdp_with_cp(mesh)
    return mesh["dp_shard_cp"]


def _hsdp_with_cp(mesh: ParallelMesh):
    # Only reached under ZeRO-3; the strategy refuses the layout earlier through the same rule.
    raise ModelMappingError(hsdp_zero3_cp(Combination(mesh.layout, zero=ZeroStage.PARAMETERS)))


def apply_fsdp(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: ParallelMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    inner: Sequence[nn.Module] = (),
    root_holds_blocks: bool = False,
) -> list[FSDPModule]:
    """Shard ``module`` in place; returns the FSDP units, outermost last. ``inner``: units
    already sharded on another mesh (experts), whose parameters the blocks leave to them.
    ``root_holds_blocks``: the outermost unit must contain the blocks too, even on a rank that
    holds nothing else (a middle pipeline stage), so that one FSDP root owns every unit."""
    dp_mesh = fsdp_mesh(mesh)
    policy = mp_policy or MixedPrecisionPolicy()
    units: list[FSDPModule] = []
    done = {id(m) for m in inner}
    if any(isinstance(m, FSDPModule) and id(m) not in done for m in module.modules()):
        raise RuntimeError(
            "this module is already sharded by FSDP (a previous Trainer?); build a fresh module for a new "
            "FiveDStrategy, or reuse the same Trainer."
        )
    heads = []
    for i, block in enumerate(blocks):
        # The last block's parameters are needed first in backward: keep them gathered.
        group = _with_forward(block)
        fully_shard(group, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
        members = group if isinstance(group, list) else [group]
        units.extend(members)  # type: ignore[arg-type]
        heads.append(members[0])
    taken = {id(p) for b in blocks for p in b.parameters()} | {id(p) for m in inner for p in m.parameters()}
    for unit, reshard in _outer_units(module, blocks, taken, in_pipeline=root_holds_blocks):
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
        units.extend(unit if isinstance(unit, list) else [unit])  # type: ignore[arg-type]
    root = _root_for_remaining(module, blocks, root_holds_blocks)
    if root is not None:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy)
        units.extend(root if isinstance(root, list) else [root])  # type: ignore[arg-type]
    if dp_mesh.device_type != "cpu":
        _set_prefetch(heads)
    gather_in_place(units)
    return units


def _with_forward(block: nn.Module) -> nn.Module | list[nn.Module]:
    """The block itself, or for a container block (an ``nn.ModuleList`` the model iterates, whose
    own forward never runs) its children as one unit: FSDP2 gathers a list of modules together."""
    if isinstance(block, (nn.ModuleList, nn.ModuleDict)):
        members = [m for m in _flat(block) if any(True for _ in m.parameters())]
        if members:
            return members
    return block


def _flat(module: nn.Module) -> list[nn.Module]:
    """Modules with a forward of their own under ``module`` (nested containers opened)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [m for c in module.children() for m in _flat(c)]
    return [module]


def apply_expert_fsdp(experts, mesh: ParallelMesh, mp_policy: MixedPrecisionPolicy | None = None) -> list[FSDPModule]:
    """Shard each rank's experts over the ranks that hold the same experts (edp), before the
    blocks are sharded over dp x cp (FSDP2 then leaves the experts' parameters to these units)."""
    edp = mesh.expert_root[("dp_replicate", "edp_shard")] if mesh.size("dp_replicate") > 1 else mesh["edp_shard"]
    policy = mp_policy or MixedPrecisionPolicy()
    units: list[FSDPModule] = []
    for module in experts.local_expert_modules():
        fully_shard(module, mesh=edp, mp_policy=policy)
        # Each expert's gradient already sums its whole ep group's tokens: the sum over edp
        # covers every dp x cp rank once, so divide by dp x cp rather than by the edp size.
        module.set_gradient_divide_factor(float(mesh.size("dp_cp")))
        # A sum plus a scale: gloo has no PREMUL_SUM. Not where each expert lives on one rank of its
        # shard group (edp_shard = 1, e.g. ep = dp_shard x cp): torch (2.13) then skips the
        # reduce-scatter and divides by the factor, and with a forced sum divides by it once more
        # afterwards (expert gradients at 1/(dp x cp) of their value; Adam hid it at 1e-4). Without
        # it, the division happens once and the only collective left is the replicas' all-reduce SUM.
        if mesh.size("edp_shard") > 1:
            module.set_force_sum_reduction_for_comms(True)
        units.append(module)  # type: ignore[arg-type]
    gather_in_place(units)
    return units


def apply_fp8_gather_units(
    linears: Sequence[nn.Module], mesh: ParallelMesh, reduce_dtype: torch.dtype | None
) -> list[FSDPModule]:
    """Shard each FP8-all-gather linear as its own unit, before the blocks.

    Its weight arrives as fp32 (the fp8 values, dequantized exactly) and so gets an fp32
    gradient, while a block unit under a bf16 policy makes bf16 gradients for its norms;
    FSDP2 reduce-scatters one dtype per unit, so the linears cannot share the block's unit.
    """
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    units: list[FSDPModule] = []
    for linear in linears:
        fully_shard(linear, mesh=fsdp_mesh(mesh), mp_policy=policy)
        units.append(linear)  # type: ignore[arg-type]
    return units


def _outer_units(
    module: nn.Module, blocks: Sequence[nn.Module], taken: set[int], in_pipeline: bool
) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """Units for the large parameters outside the blocks, so that the root holds only what is left.

    Each token embedding (an ``nn.Embedding``) is its own unit, resharded after its forward: it
    is used first in forward and last in backward, so keeping it gathered would hold Vh for the
    whole step. Every other leaf that owns parameters outside the blocks (final norm, head) stays
    gathered after forward: it runs last in forward and first in backward, so resharding it would
    only gather it again at once. The largest of them gets a unit of its own when it holds one
    parameter (an untied head): a one-parameter unit gathers in place (``gather_in_place``), once
    instead of twice its size; the others (the final norm) share one unit (FSDP2 gathers a list
    together).
    Modules that share a parameter with another module (a head tied to the embedding) stay in
    the root, as one unit must hold a shared parameter; so do parameters set directly on a
    container of the blocks (their forward is the container's) and any module holding
    parameters next to children that hold some, with those children. Under pp every unit keeps
    its parameters across the schedule's microbatches (``in_pipeline``: no reshard after forward).
    """
    owners: dict[int, list[nn.Module]] = {}
    containers = {id(m) for m in module.modules() if any(id(p) in taken for p in m.parameters())}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    # A module with parameters of its own and children with parameters (its forward may read a
    # child's weight directly, where a unit's hooks on the child would not see it): its whole
    # subtree stays in the root.
    mixed = [
        name + "."
        for name, m in module.named_modules()
        if m is not module and id(m) not in containers
        and any(True for _ in m.parameters(recurse=False)) and any(True for c in m.children() for _ in c.parameters())
    ]
    embeddings: list[nn.Module] = []
    rest: list[nn.Module] = []
    for name, m in module.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in taken]
        if not own or id(m) in containers or m is module:
            continue
        # A shared parameter (tied head): one unit must hold it, the root's.
        if any(len(owners[id(p)]) > 1 for p in own) or any(f"{name}.".startswith(pre) for pre in mixed):
            continue
        (embeddings if isinstance(m, nn.Embedding) else rest).append(m)
    out: list[tuple[nn.Module | list[nn.Module], bool]] = [(e, not in_pipeline) for e in embeddings]
    largest = max(rest, key=_own_numel, default=None)
    if largest is not None and len(rest) > 1 and len(list(largest.parameters(recurse=False))) == 1:
        rest = [m for m in rest if m is not largest]
        out.append((rest if len(rest) > 1 else rest[0], False))
        out.append((largest, False))
    elif rest:
        out.append((rest if len(rest) > 1 else rest[0], False))
    return out


def _own_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _set_prefetch(blocks: Sequence[FSDPModule]) -> None:
    # One block ahead in both directions: gathers overlap compute, memory stays ~2 blocks.
    # Not on CPU: gloo's collectives block the calling thread, so a prefetched gather runs
    # before the block it serves and overlaps nothing; it only held a third block gathered
    # (block N running, N+1 gathered, N+2 being gathered: +96 MiB per rank at 0.5 B).
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def _root_for_remaining(
    module: nn.Module, blocks: Sequence[nn.Module], holds_blocks: bool
) -> nn.Module | list[nn.Module] | None:
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    owners = [
        name.rsplit(".", 1)[0] if "." in name else ""
        for name, p in module.named_parameters(remove_duplicate=False)
        if id(p) not in in_blocks
    ]
    if holds_blocks and blocks:
        # The block list's parent, not the list itself: a ModuleList's forward never runs.
        ids = {id(b) for b in blocks}
        block_path = next(name for name, m in module.named_modules() if id(m) in ids)
        owners.append(".".join(block_path.split(".")[:-2]))
    if not owners:
        return None
    prefix = _common_prefix([o.split(".") if o else [] for o in owners])
    if not prefix and not holds_blocks:
        # Embedding, final norm and head (or bare parameters) straight on the LightningModule:
        # it is the root unit. FSDP2 needs one root above the block units, so a list of those
        # modules cannot be it; the strategy runs the steps through the module's forward
        # (forward_redirection) so that the root's hooks gather them.
        return module
    if not prefix:
        raise ModelMappingError(
            f"ZeRO-3 shards the parameters outside the blocks in units whose forward runs, but "
            f"{type(module).__name__} holds parameters directly on itself ({sorted(set(owners))[:4]}), and "
            f"Lightning calls its training_step, not a forward FSDP could hook. Keep them in a submodule "
            f"(e.g. an nn.Linear or nn.Embedding attribute), or use zero=0..2."
        )
    return module.get_submodule(".".join(prefix))


def _common_prefix(paths: list[list[str]]) -> list[str]:
    prefix = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def unit_is_gathered(unit: FSDPModule) -> bool:
    """Whether ``unit`` holds its parameters unsharded (FSDP2 then registers those on the module)."""
    return any(group.is_unsharded for group in fully_shard.state(unit)._fsdp_param_groups)


def set_gradient_sync(units: Sequence[FSDPModule], enabled: bool) -> None:
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


def default_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
