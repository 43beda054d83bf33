"""ZeRO-3: parameters, gradients and optimizer states sharded with FSDP2 ``fully_shard``.

One FSDP unit per transformer block (so at most one block's parameters are gathered at a
time) plus one for the module that owns everything else (embedding, final norm, head).
That module is the lowest common ancestor of the remaining parameters, not the
LightningModule itself: Lightning calls ``training_step``, not ``forward``, so FSDP's
forward hooks on the LightningModule would never unshard those parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_5d.config import ZeroStage
from lightning_5d.layout_rules import Combination, hsdp_zero3_cp
from lightning_5d.mesh import ParallelMesh
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
    for i, block in enumerate(blocks):
        # The last block's parameters are needed first in backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
        units.append(block)  # type: ignore[arg-type]
    root = _root_for_remaining(module, blocks, root_holds_blocks)
    if root is not None:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy)
        units.append(root)  # type: ignore[arg-type]
    _set_prefetch(units[: len(blocks)])
    return units


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
        module.set_force_sum_reduction_for_comms(True)  # a sum plus a scale: gloo has no PREMUL_SUM
        units.append(module)  # type: ignore[arg-type]
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


def _set_prefetch(blocks: Sequence[FSDPModule]) -> None:
    # One block ahead in both directions: gathers overlap compute, memory stays ~2 blocks.
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def _root_for_remaining(module: nn.Module, blocks: Sequence[nn.Module], holds_blocks: bool) -> nn.Module | None:
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
    if not prefix:
        raise ModelMappingError(
            f"ZeRO-3 needs one submodule that holds every parameter outside the blocks, but "
            f"{type(module).__name__} keeps some directly on itself or in sibling modules "
            f"({sorted(set(owners))[:4]}). Move the embedding, blocks, final norm and head into one "
            f"nn.Module attribute (e.g. `self.model`) and call it from training_step, or use zero=0..2."
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


def set_gradient_sync(units: Sequence[FSDPModule], enabled: bool) -> None:
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


def default_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
