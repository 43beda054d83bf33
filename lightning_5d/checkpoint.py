"""Checkpoint files for the 5D strategy.

Today's format is layout-independent: every tensor is gathered to its full shape and the
optimizer state is keyed by parameter name (torch.distributed.checkpoint's full format,
which every ZeRO stage writes and reads), so a checkpoint written under one data-parallel
layout loads under any other. Local files are written to a temporary name and renamed,
so a crash mid-save never leaves a truncated file under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only, on CPU
# Every rank gets full-over-data tensors: tensor parallelism still has to gather its shards.
_FULL_EVERY_RANK = StateDictOptions(full_state_dict=True, cpu_offload=False)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names the file and what to do."""


def full_model_state(module: nn.Module, sharded: bool, every_rank: bool = False) -> dict[str, Any]:
    if not sharded:
        return module.state_dict()
    return get_model_state_dict(module, options=_FULL_EVERY_RANK if every_rank else _FULL)


def load_full_model_state(module: nn.Module, state: Mapping[str, Any], sharded: bool, strict: bool = True) -> None:
    if sharded:
        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))
    else:
        module.load_state_dict(state, strict=strict)


def dcp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, every_rank: bool = False) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=_FULL_EVERY_RANK if every_rank else _FULL)


def load_dcp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=True))


def _is_local(filepath: str | os.PathLike) -> bool:
    return "://" not in str(filepath)


def atomic_save(checkpoint: dict[str, Any], filepath: str | os.PathLike, checkpoint_io, storage_options=None) -> None:
    # The rename is only atomic, and only safe, for a synchronous write to a local file:
    # remote URLs and asynchronous checkpoint IO go straight through.
    if not (_is_local(filepath) and type(checkpoint_io) is TorchCheckpointIO):
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    path = Path(filepath)
    tmp = path.with_name(f".{path.name}.partial")
    checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
    os.replace(tmp, path)


def load_file(checkpoint_io, filepath: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    path = Path(filepath) if _is_local(filepath) else filepath
    if _is_local(filepath) and not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is a directory); pass the path of a .ckpt file.")
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(err).__name__}: {err}). It may be truncated or "
            f"not a Lightning checkpoint; resume from an earlier one. The file was left untouched."
        ) from err
