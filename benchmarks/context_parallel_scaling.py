"""Step time and peak memory against sequence length for cp = 1, 2, 4 — waits for context parallelism.

What it will measure once ``cp > 1`` trains: for a fixed model and a growing sequence, the
step time and peak memory per rank at cp = 1, 2, 4 (ring and zig-zag attention), next to the
planner's activation memory. Until then it records that it is pending and makes up no number.
"""

from __future__ import annotations

from benchmarks.common import pending_note

DIM = "cp"


def run(quick: bool) -> dict:
    return {"command": "python -m benchmarks run --only context_parallel_scaling", "status": pending_note(DIM)}


def markdown(result: dict) -> str:
    return (
        f"**{result['status']}.** Will report step time and peak memory per rank against sequence length "
        "for cp = 1, 2, 4 (ring and zig-zag), next to the planner's activation memory. No numbers until then."
    )
