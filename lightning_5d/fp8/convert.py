"""Swapping a model's chosen ``nn.Linear`` layers for :class:`Fp8Linear` in place.

Which layers to convert is decided elsewhere (the plan knows which linears are projections worth
running in FP8 and which, like the output head, usually are not); this module only performs the
swap, keeping parameter identity so that nothing holding the parameters has to be told.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from lightning_5d.fp8.delayed import amax_histories, pending_buffer_name
from lightning_5d.fp8.linear import Fp8Linear, Fp8Projection
from lightning_5d.fp8.recipes import Fp8Recipe
from lightning_5d.mha_parts import own_forward


def _lookup(root: nn.Module, name: str) -> nn.Module:
    try:
        return root.get_submodule(name)
    except AttributeError as err:
        raise ValueError(f"convert_to_fp8: no submodule at {name!r} ({err})") from None


def convert_to_fp8(root: nn.Module, names: Iterable[str], recipe: Fp8Recipe | str, **options: Any) -> list[str]:
    """Replace the ``nn.Linear`` at each dotted path in ``names`` by an Fp8Linear sharing its
    parameters; return the paths converted now (ones that already are Fp8Linear are left as they
    are and not returned). Every path is checked before anything changes, so a bad path leaves the
    model untouched."""
    recipe = Fp8Recipe(recipe)
    Fp8Linear._check_options(options)
    todo: list[tuple[str, nn.Linear]] = []
    seen: set[str] = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        if not name:
            raise ValueError("convert_to_fp8: the root module itself cannot be replaced; name a submodule path")
        module = _lookup(root, name)
        if isinstance(module, Fp8Linear):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"convert_to_fp8: {name!r} is a {type(module).__name__}, not an nn.Linear")
        todo.append((name, module))
    converted = []
    for name, module in todo:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        if isinstance(parent, nn.MultiheadAttention):
            # torch's forward multiplies by out_proj.weight itself and would never call the new
            # module (FP8 silently unused): the forward built from its parts calls it.
            own_forward(parent)
        setattr(parent, child, Fp8Linear.from_linear(module, recipe, **options))
        converted.append(name)
    return converted


def fp8_linears(root: nn.Module) -> dict[str, Fp8Linear]:
    """Every Fp8Linear under ``root`` by its dotted path."""
    return {name: m for name, m in root.named_modules() if isinstance(m, Fp8Linear)}


def fp8_gemm_modules(root: nn.Module) -> dict[str, Fp8Linear | Fp8Projection]:
    """Every module under ``root`` that runs FP8 GEMMs (and may keep delayed-scaling histories):
    the Fp8Linears and the parameterless Fp8Projections of nn.MultiheadAttention's in-projection."""
    return {name: m for name, m in root.named_modules() if isinstance(m, (Fp8Linear, Fp8Projection))}


def advance_fp8_histories(root: nn.Module, group=None) -> None:
    """After an optimizer step: every delayed-scaling Fp8Linear under ``root`` takes in the step's
    amaxes. ``group``: ranks whose pending amaxes are max-reduced first (one collective for all)."""
    modules = [m for m in fp8_gemm_modules(root).values() if amax_histories(m)]
    if not modules:
        return
    if group is not None and torch.distributed.get_world_size(group) > 1:
        pending = [getattr(m, pending_buffer_name(role)) for m in modules for role in amax_histories(m)]
        stacked = torch.stack(pending)
        torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX, group=group)
        for buffer, value in zip(pending, stacked):
            buffer.copy_(value)
    for module in modules:
        module.advance_history()


def fp8_scaling_state(root: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The delayed-scaling histories under ``root`` by module path (empty for the other recipes);
    kept out of the modules' state_dict so the weights load into the model without FP8 too."""
    return {
        name: {role: h.detach().clone() for role, h in amax_histories(m).items()}
        for name, m in fp8_gemm_modules(root).items()
        if amax_histories(m)
    }


def load_fp8_scaling_state(root: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    modules = fp8_gemm_modules(root)
    for name, histories in state.items():
        module = modules.get(name)
        if module is None:
            continue  # saved under another layout or recipe: that module starts a fresh history
        own = amax_histories(module)
        for role, value in histories.items():
            if role in own and own[role].shape == value.shape:
                own[role].copy_(value)
