"""Checkpoint files for the 5D strategy.

Today's format is layout-independent: every tensor is gathered to its full shape, so a
checkpoint written under one data-parallel layout loads under any other (ZeRO stages 0-2
share the optimizer format of plain PyTorch; ZeRO-3 uses torch.distributed.checkpoint's
full, FQN-keyed format). Files are written to a temporary name and renamed, so a crash
mid-save never leaves a truncated file under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names the file and what to do."""


def full_model_state(module: nn.Module, sharded: bool) -> dict[str, Any]:
    return get_model_state_dict(module, options=_FULL) if sharded else module.state_dict()


def load_full_model_state(module: nn.Module, state: Mapping[str, Any], sharded: bool, strict: bool = True) -> None:
    if sharded:
        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))
    else:
        module.load_state_dict(state, strict=strict)


def fsdp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=_FULL)


def load_fsdp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=True))


def atomic_save(checkpoint: dict[str, Any], filepath: str | os.PathLike, checkpoint_io, storage_options=None) -> None:
    path = Path(filepath)
    tmp = path.with_name(f".{path.name}.partial")
    checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
    os.replace(tmp, path)


def load_file(checkpoint_io, filepath: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    path = Path(filepath)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is a directory); pass the path of a .ckpt file.")
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(err).__name__}: {err}). It may be truncated or "
            f"not a Lightning checkpoint; resume from an earlier one. The file was left untouched."
        ) from err
