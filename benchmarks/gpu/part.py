"""What the suite hands each part, and the small formatting rules every part's table shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu.hardware import Card, Deadline
from benchmarks.gpu.workload import Sizes


@dataclass
class PartContext:
    sizes: Sizes
    card: Card
    deadline: Deadline
    out: Path  # the run's output folder (the planner's model config is written there)
    fp8_recipes: tuple[str, ...]

    @property
    def device(self) -> torch.device:
        return self.card.device


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f} %"


def size(n: float | None) -> str:
    """Bytes in binary units (GiB = 2^30), the unit the planner reports in."""
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.2f} ms"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
