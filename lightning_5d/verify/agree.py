"""One decision for every rank when the probe fails on some (a collective over the world).

Under pp a probe forward can fail on one stage's ranks only (a block that cannot run under
tp); the pipeline then stops its other stages with a :class:`PipelinePeerError` naming the
failing rank. Without agreement each rank would raise its own message, or, worse, a rank
whose probe ran would go on into the comparison's collectives while its peers had left.
:func:`first_failure` gathers "failed + message" from every rank; every rank then raises
the same error: the first rank's own failure (not a peer's echo of it), naming that rank.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_5d.parallel.pipeline.failure import PipelinePeerError


def _echoes_a_peer(error: BaseException) -> bool:
    """Whether ``error`` only reports another rank's failure (a stage whose peer stage raised)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, PipelinePeerError):
            return True
        seen = seen.__cause__
    return False


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """(rank, message) of the failure every rank reports, or None when no rank failed.

    Collective: every rank of the world calls it, failed or not. The lowest rank whose own
    forward raised wins; only if every failure echoes a peer (cannot happen when the failing
    rank took part) the lowest such rank.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    mine = None if error is None else (rank, str(error), _echoes_a_peer(error))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    failures = [g for g in gathered if g is not None]
    if not failures:
        return None
    primary = [f for f in failures if not f[2]] or failures
    return primary[0][0], primary[0][1]
