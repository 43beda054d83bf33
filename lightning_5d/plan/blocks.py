"""Find the repeated transformer blocks of an arbitrary module.

A first, structural piece of model discovery: the ``nn.ModuleList`` holding the most
parameters whose children all share one class. Sharding and activation checkpointing
work per block, so this is what they need.
"""

from __future__ import annotations

from torch import nn


class ModelMappingError(ValueError):
    """The model's structure could not be mapped; the message shows the config that fixes it."""


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return the dotted path of the block list and its blocks (``("", [])`` if none)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        size = _num_params(child)
        if size and (best is None or size > best[0]):
            best = (size, name, child)
    if best is None:
        return "", []
    return best[1], list(best[2])


def require_blocks(module: nn.Module, why: str) -> tuple[str, list[nn.Module]]:
    path, blocks = find_blocks(module)
    if not blocks:
        raise ModelMappingError(
            f"{why} needs the model's repeated blocks, but {type(module).__name__} has no "
            f"nn.ModuleList of identical modules with parameters. Put the transformer blocks in an "
            f"nn.ModuleList (e.g. `self.layers = nn.ModuleList([Block(...) for _ in range(n)])`)."
        )
    return path, blocks
