"""Keep throw-away tensors from leaving resident pages behind in the C heap.

Used by the meta build (:mod:`.materialize.record`: scratch tensors of the recorded draws;
:mod:`.materialize.apply`: each full tensor once its piece is cut), the plan verifier (each piece's
gathered weights once compared) and the pipeline (a unit left gathered by a stopped forward). It
imports nothing of the project, so none of them imports another's package for it.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch


def release_freed_memory() -> None:
    """Give the full tensors' freed pages back to the OS (glibc keeps freed heap memory below
    its mmap threshold, ~32 MiB, for reuse: per-rank RSS would otherwise stay near the peak)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    # Looked up once: a CDLL object per call (the verifier calls this after every piece) left
    # ctypes' reference cycles for the garbage collector each time.
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim, or the allocator returns pages itself
        return None


def scratch_storage(nbytes: int) -> torch.UntypedStorage:
    """A zeroed CPU storage of ``nbytes`` mapped from the OS, not taken from the C heap; unmapped
    when the last tensor on it goes.

    Why not ``torch.zeros``: glibc serves blocks up to 32 MiB from its heap once one block of
    that size was freed (its mmap threshold follows the largest freed block), and the recording
    frees one such block per draw. The heap then grows by each block (small allocations made in
    between split the freed ones) and the shards allocated later come from its freed, split
    pages, which stay resident: measured on the 0.5 B reference model, 3-4 MiB per rank at the
    materialization's peak above Lightning's (benchmarks/startup_memory.py). A private mapping
    leaves the heap and its threshold as they were. Fresh anonymous pages read as zeros.
    """
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()
