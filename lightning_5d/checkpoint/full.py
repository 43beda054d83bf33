"""The full format: one Lightning checkpoint file, every tensor gathered to its full shape.

The optimizer state is keyed by parameter name (torch.distributed.checkpoint's full
format, which every ZeRO stage writes and reads), so the file loads under any layout and
into plain Lightning. Rank 0 writes it under a temporary name and renames it, so a crash
mid-save never leaves a truncated file under the final name.
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

from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.files import is_local, partial_path, update_latest

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only, on CPU
# Every rank gets full-over-data tensors: tensor parallelism still has to gather its shards.
_FULL_EVERY_RANK = StateDictOptions(full_state_dict=True, cpu_offload=False)


def full_model_state(module: nn.Module, sharded: bool, every_rank: bool = False) -> dict[str, Any]:
    if not sharded:
        return module.state_dict()
    return get_model_state_dict(module, options=_FULL_EVERY_RANK if every_rank else _FULL)


def load_full_model_state(module: nn.Module, state: Mapping[str, Any], sharded: bool, strict: bool = True) -> None:
    if sharded:
        set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))
    else:
        module.load_state_dict(state, strict=strict)


def dcp_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, every_rank: bool = False
) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=_FULL_EVERY_RANK if every_rank else _FULL)


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Name-keyed, FSDP2's shards left as DTensors (for the sharded format to write as they are)."""
    return get_optimizer_state_dict(module, optimizer)


def load_dcp_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=True))


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: Mapping[int, str]
) -> None:
    """A name-keyed state whose values are already what each parameter holds on this rank (FSDP2
    shards as DTensors), loaded as it is. (torch's set_optimizer_state_dict would first create
    every state by a zero-gradient step, holding the states twice and the gradients once more.)"""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {names[id(p)]: i for i, p in enumerate(params)}
    unknown = sorted(set(state["state"]) - set(index))
    if unknown:
        raise ValueError(f"the checkpoint has optimizer state for unknown parameters {unknown[:3]}")
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    optimizer.load_state_dict({"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups})


def atomic_save(
    checkpoint: dict[str, Any], filepath: str | os.PathLike, checkpoint_io, storage_options=None, branch=None, step=None
) -> list[str]:
    """Write, rename, then record it in the folder's lineage (``branch``) and move `latest`;
    returns the lineage record's notes for the log."""
    # The rename is only atomic, and only safe, for a synchronous write to a local file:
    # remote URLs and asynchronous checkpoint IO go straight through.
    if not (is_local(filepath) and type(checkpoint_io) is TorchCheckpointIO):
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return []
    path = Path(filepath)
    tmp = partial_path(path)
    checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
    os.replace(tmp, path)
    return update_latest(path, branch, step)


def load_file(checkpoint_io, filepath: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    path = Path(filepath) if is_local(filepath) else filepath
    if is_local(filepath) and not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is a directory); pass the path of a .ckpt file.")
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} could not be read ({type(err).__name__}: {err}). It may be truncated or "
            f"not a Lightning checkpoint; resume from an earlier one. The file was left untouched."
        ) from err
