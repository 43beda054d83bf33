"""The one error type of checkpoint reading and writing, and every rank learning of any rank's."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


def first_problem(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (a collective)."""
    if not dist.is_initialized():
        return problem
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return next((p for p in everyone if p is not None), None)


def failure(what: str, error: str) -> CheckpointError:
    return CheckpointError(f"{what}: {error}. Nothing already on disk was changed.")


def raise_if_any(error: str | None, what: str) -> None:
    """Raise on every rank if any rank has an error (a collective: a lone raising rank
    would leave the others waiting in the next one)."""
    error = first_problem(error)
    if error is not None:
        raise failure(what, error)
