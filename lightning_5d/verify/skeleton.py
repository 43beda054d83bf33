"""The unparallelized pieces, kept as weightless copies until each is checked.

Taken before any dimension changes the model: each piece (embedding, position embedding,
every block, final norm, head) is deep-copied with every parameter and buffer replaced by
a tensor on the ``meta`` device, so the copy keeps the piece's own classes, attributes and
``forward`` (an embedding subclass that scales its output, a head count read at forward
time) at no memory cost. One piece at a time is then given real storage, filled with the
full weights gathered from the parallel model, run, and dropped (:func:`materialize`).

A container block (an ``nn.ModuleList`` / ``nn.ModuleDict`` of sub-layers that the model's
own loop calls, ``for attn, ff in layers``) is never called itself, so no call of it has an
input and an output to compare: each of its sub-layers with parameters is a piece of its own
instead (``block 3 [0]``, ``block 3 [1]``), as FSDP2 makes them one unit together
(:func:`lightning_5d.parallel.data.fsdp._with_forward`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum
from typing import MutableMapping

import torch
from torch import Tensor, nn

from lightning_5d.plan.blocks import find_blocks
from lightning_5d.plan.model_plan import BlockPlan, ModelPlan


class PieceKind(str, Enum):
    EMBEDDING = "embedding"
    POSITION_EMBEDDING = "position embedding"
    BLOCK = "block"
    FINAL_NORM = "final norm"
    HEAD = "head"


@dataclass(frozen=True)
class Piece:
    """One unit of the check: where it lives in the model and its weightless copy."""

    kind: PieceKind
    path: str  # dotted path from the LightningModule
    copy: nn.Module  # on the meta device
    index: int | None = None  # the block index
    block_plan: BlockPlan | None = None  # what is inside a block (for naming its wrong projection)
    # A sub-layer of a container block: its path relative to the block ("0", "attn"); "" otherwise.
    # ``block_plan`` stays the whole block's (its paths are relative to the block).
    within: str = ""

    @property
    def name(self) -> str:
        if self.kind != PieceKind.BLOCK:
            return self.kind.value
        return f"block {self.index}" + (f" [{self.within}]" if self.within else "")


def _weightless(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose tensors live on the meta device (no storage is copied)."""
    memo: dict[int, object] = {}
    for p in module.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def take_skeleton(module: nn.Module, plan: ModelPlan | None) -> list[Piece]:
    """The pieces of ``module`` as ``plan`` names them (blocks only when there is no plan)."""
    pieces: list[Piece] = []
    if plan is None:
        path, blocks = find_blocks(module)
        return [p for i, b in enumerate(blocks) for p in _block_pieces(f"{path}.{i}" if path else str(i), b, i, None)]
    for kind, path in ((PieceKind.EMBEDDING, plan.embedding), (PieceKind.POSITION_EMBEDDING, plan.position_embedding)):
        if path:
            pieces.append(Piece(kind, path, _weightless(module.get_submodule(path))))
    for i, block_plan in enumerate(plan.block_plans):
        path = plan.block_path(i)
        pieces.extend(_block_pieces(path, module.get_submodule(path), i, block_plan))
    for kind, path in ((PieceKind.FINAL_NORM, plan.final_norm), (PieceKind.HEAD, plan.head)):
        if path:
            pieces.append(Piece(kind, path, _weightless(module.get_submodule(path))))
    return pieces


def _block_pieces(path: str, block: nn.Module, index: int, plan: BlockPlan | None) -> list[Piece]:
    """The block as one piece, or, for a container block, one piece per sub-layer."""
    layers = sub_layers(block)
    if layers is None:
        return [Piece(PieceKind.BLOCK, path, _weightless(block), index, plan)]
    return [Piece(PieceKind.BLOCK, f"{path}.{rel}", _weightless(m), index, plan, within=rel) for rel, m in layers]


def is_container(module: nn.Module) -> bool:
    """A module whose own ``forward`` never runs: ``nn.ModuleList`` / ``nn.ModuleDict`` (and the like)."""
    return type(module).forward is nn.Module.forward


def sub_layers(block: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """A container block's sub-layers with parameters (nested containers opened), by path
    relative to the block, in order; None for a block that has a ``forward`` of its own."""
    if not is_container(block):
        return None
    found: list[tuple[str, nn.Module]] = []
    for name, child in block.named_children():
        inner = sub_layers(child)
        if inner is None:
            if any(True for _ in child.parameters()):
                found.append((name, child))
        else:
            found.extend((f"{name}.{rel}", m) for rel, m in inner)
    return found


def tensor_names(module: nn.Module) -> list[str]:
    """Every parameter and buffer of ``module`` (non-persistent buffers too: a rotary table)."""
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    return names + [n for n, _ in module.named_buffers(remove_duplicate=False)]


def materialize(
    piece: Piece, full: MutableMapping[str, Tensor], device: torch.device, trainable: bool = False
) -> nn.Module:
    """The unparallelized piece in fp32 on ``device``, holding the full tensors ``full`` (by name);
    ``trainable``: its parameters require gradients as the model's did (for the backward check).

    Each tensor of ``full`` (fresh gathers, copies, or live tensors that outlive the piece, as
    :func:`~.gather.full_weights` gives) is taken out of it and placed in the piece as it is
    (a parameter becomes a new leaf over the same storage), so the gathered weights exist
    once, in the piece, and go with it (no empty copy of the piece is allocated first). The
    piece's forward and backward never write its parameters; a buffer (which a forward may
    update) is copied.
    """
    reference = copy.deepcopy(piece.copy)  # on meta: every tensor is replaced below
    with torch.no_grad():
        for name in tensor_names(reference):
            owner_path, _, leaf = name.rpartition(".")
            owner = reference.get_submodule(owner_path)
            value = full.pop(name).to(device)
            if value.is_floating_point():
                value = value.float()
            current = getattr(owner, leaf)
            if isinstance(current, nn.Parameter):
                wanted = trainable and current.requires_grad and value.is_floating_point()
                setattr(owner, leaf, nn.Parameter(value, requires_grad=wanted))
            else:
                setattr(owner, leaf, value.clone())  # a buffer may be the live one (small: rotary tables)
    # Eval mode whatever mode the copy was taken in (a module is built in training mode): the probe
    # runs the parallel model in eval mode, so dropout is off on both sides.
    return reference.eval()
