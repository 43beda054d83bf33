"""Leaving the job's process group together at interpreter exit.

Gloo aborts the process if its groups are still alive during interpreter shutdown, which
would turn every finished run into a crash; and a rank that tears its connections down
while a peer still flushes the last collective makes that peer abort. So at exit every
rank meets the others once, then destroys the group, unless the run failed (then peers
may never arrive).
"""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch.distributed as dist


class _ExitState:
    registered = False
    failed = False  # a run failed: peers may never reach the exit barrier


_EXIT = _ExitState()


def leave_together_at_exit() -> None:
    """Register the exit handler once per process (a later Trainer may reuse the group)."""
    if not _EXIT.registered:
        atexit.register(_destroy_process_group)
        _EXIT.registered = True


def mark_failed() -> None:
    """Peers may be gone: leave without waiting for them."""
    _EXIT.failed = True


def _destroy_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        # Gloo's monitored barrier has rank 0 acknowledge every rank, so nobody leaves before
        # everyone has arrived; it is bounded by its timeout.
        if not _EXIT.failed and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
    except Exception:
        pass  # leaving anyway
    finally:
        dist.destroy_process_group()
