"""Pipeline bubble per schedule, measured next to its formula — waits for pipeline parallelism.

What it will measure once ``pp > 1`` trains: for AFAB, 1F1B, interleaved 1F1B, ZB and
DualPipeV, the idle fraction of each stage per step (from per-stage busy time) next to
``lightning_5d.estimate.bubble_fraction`` (e.g. (p-1)/(m+p-1) for 1F1B). Until then it
records that it is pending and makes up no number.
"""

from __future__ import annotations

from benchmarks.common import pending_note

DIM = "pp"


def run(quick: bool) -> dict:
    return {"command": "python -m benchmarks run --only pipeline_bubble", "status": pending_note(DIM)}


def markdown(result: dict) -> str:
    return (
        f"**{result['status']}.** Will report, per schedule (AFAB, 1F1B, interleaved 1F1B, ZB, DualPipeV), "
        "the measured idle fraction of each stage next to the planner's `bubble_fraction`. No numbers until then."
    )
