"""The strategy's checkpoint options (``checkpoint_format``, ``checkpoint_write``, ``keep_last_k``), checked up front."""

from __future__ import annotations

from enum import Enum


class CheckpointFormat(str, Enum):
    SHARDED = "sharded"  # a directory: every rank writes its pieces (torch.distributed.checkpoint)
    FULL = "full"  # one Lightning file, gathered to rank 0: loads anywhere, also without lightning_5d


class CheckpointWrite(str, Enum):
    SYNC = "sync"
    ASYNC = "async"  # the sharded format's files are written in a background thread


def checked_options(
    format: str | CheckpointFormat, write: str | CheckpointWrite, keep_last_k: int | None
) -> tuple[CheckpointFormat, CheckpointWrite, int | None]:
    """The checkpoint options, or a ValueError naming the bad value and the valid ones."""
    for value, kind in ((format, CheckpointFormat), (write, CheckpointWrite)):
        if value not in {m.value for m in kind} and not isinstance(value, kind):
            raise ValueError(f"{value!r} is not a {kind.__name__}; use one of {[m.value for m in kind]}.")
    format, write = CheckpointFormat(format), CheckpointWrite(write)
    if keep_last_k is not None and (not isinstance(keep_last_k, int) or keep_last_k < 1):
        raise ValueError(f"keep_last_k={keep_last_k!r}: keep at least 1 checkpoint, or None to keep all.")
    if write == CheckpointWrite.ASYNC and format != CheckpointFormat.SHARDED:
        raise ValueError("checkpoint_write='async' needs checkpoint_format='sharded'.")
    return format, write, keep_last_k
