"""Keep throw-away tensors from leaving resident pages behind in the C heap.

Used by the meta build (:mod:`.materialize.record`: scratch tensors of the recorded draws, and
the draws' generator states until they are replayed;
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


class MappedCopies:
    """Copies of small CPU tensors kept on pages mapped from the OS, packed ``mapping_bytes`` to a
    mapping; a mapping is unmapped when the last copy on it is freed.

    For the meta build's generator states (one ~5 KB state per recorded draw, 228 for the 0.5 B
    reference model): taken from the C heap, each state sat between long-lived objects the model's
    construction allocated at the same time, and freeing the states once replayed left holes of
    one to two pages that glibc neither reuses nor returns (measured, with the record's Python
    objects, ~1.8 MiB per rank above Lightning's start-up; benchmarks/RESULTS.md "gap2"). The
    states are dropped in about the order they were recorded, so a mapping's copies go together.
    """

    _ALIGN = 64  # what torch's CPU allocator aligns to

    def __init__(self, mapping_bytes: int = 64 * 1024) -> None:
        self.mapping_bytes = mapping_bytes
        self._mapping: mmap.mmap | None = None
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` (same dtype and shape) on a mapped page, on a storage of its own
        (a generator's ``set_state`` reads its state from the start of the storage, whatever the offset)."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return t.detach().clone()
        start = -(-self._used // self._ALIGN) * self._ALIGN
        if self._mapping is None or start + nbytes > len(self._mapping):
            self._mapping = mmap.mmap(-1, max(nbytes, self.mapping_bytes))
            start = 0
        self._used = start + nbytes
        # frombuffer holds the mapping (a buffer export) for as long as the copy's storage lives.
        out = torch.frombuffer(self._mapping, dtype=t.dtype, count=t.numel(), offset=start)
        return out.copy_(t.reshape(-1)).view(t.shape) if t.dim() != 1 else out.copy_(t)

    def close(self) -> None:
        """Map no more copies onto the current mapping (it goes with its last copy)."""
        self._mapping, self._used = None, 0
