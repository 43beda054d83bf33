"""Hand freed heap pages back to the OS between full tensors.

Used by :mod:`.record` (scratch tensors of the recorded draws) and :mod:`.apply` (each full
tensor once its piece is cut); it sits below both so neither imports the other for it.
"""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Give the full tensors' freed pages back to the OS (glibc keeps freed heap memory below
    its mmap threshold, ~32 MiB, for reuse: per-rank RSS would otherwise stay near the peak)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, or the allocator returns pages itself
        pass
