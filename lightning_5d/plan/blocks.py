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


def is_indexed_container(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` / ``nn.Sequential``, or an ``nn.ModuleDict`` keyed "0", "1", ...: a
    container whose children are reached as ``<path>.<index>``, as every block path is."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return True
    return isinstance(module, nn.ModuleDict) and list(module.keys()) == [str(i) for i in range(len(module))]


def block_modules(container: nn.Module) -> list[nn.Module]:
    """The blocks of an indexed container, in index order."""
    return list(container.children())


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """Return the dotted path of the block list and its blocks (``("", [])`` if none)."""
    best: tuple[int, str, nn.Module] | None = None
    for name, child in module.named_modules():
        if isinstance(child, nn.Sequential) or not is_indexed_container(child) or len(child) == 0:
            continue
        if len({type(block) for block in block_modules(child)}) != 1:
            continue
        size = _num_params(child)
        if size and (best is None or size > best[0]):
            best = (size, name, child)
    if best is None:
        return "", []
    return best[1], block_modules(best[2])


def require_blocks(module: nn.Module, why: str) -> tuple[str, list[nn.Module]]:
    path, blocks = find_blocks(module)
    if not blocks:
        raise ModelMappingError(
            f"{why} needs the model's repeated blocks, but {type(module).__name__} has no "
            f"nn.ModuleList (or nn.ModuleDict keyed '0', '1', ...) of identical modules with parameters. Put the "
            f"transformer blocks in one (e.g. `self.layers = nn.ModuleList([Block(...) for _ in range(n)])`)."
        )
    return path, blocks
