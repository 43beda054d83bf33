"""The card a run measures on: its name, its bf16 peak, CUDA timing and memory helpers, time budgets.

Peaks are the vendors' dense bf16 tensor-core figures (data sheets, without 2:4 sparsity, which
the sheets quote at twice these). A card missing from the table gets no MFU: a guessed peak
would make the percentage meaningless, so the report says so instead.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

# (every fragment the device name must contain, label, dense bf16 TFLOP/s), first match wins:
# the more specific names (GH200 before H200, H100 NVL/PCIe before H100) come first.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("GH200",), "GH200", 989.0),
    (("H200", "NVL"), "H200 NVL", 835.0),
    (("H200",), "H200 SXM", 989.0),
    (("H100", "NVL"), "H100 NVL", 835.0),
    (("H100", "PCIE"), "H100 PCIe", 756.0),
    (("H100",), "H100 SXM", 989.0),
    (("H800",), "H800 SXM", 989.0),
    (("B200",), "B200", 2250.0),
    (("A100",), "A100", 312.0),
    (("A800",), "A800", 312.0),
    (("L40S",), "L40S", 362.0),
    (("L40",), "L40", 181.0),
    (("L4",), "L4", 121.0),
)


@dataclass(frozen=True)
class Card:
    """The device the suite runs on and the peak its MFU divides by (None: MFU not computed)."""

    device: torch.device
    name: str
    peak_flops: float | None
    peak_source: str

    def as_dict(self) -> dict:
        return {"device": str(self.device), "name": self.name, "peak_bf16_tflops": _tflops(self.peak_flops),
                "peak_source": self.peak_source}  # fmt: skip


def _tflops(flops: float | None) -> float | None:
    return None if flops is None else flops / 1e12


def peak_for_name(name: str) -> tuple[str, float] | None:
    """(table label, dense bf16 TFLOP/s) for a CUDA device name, or None when the card is not listed."""
    upper = name.upper()
    for fragments, label, tflops in PEAK_BF16_TFLOPS:
        if all(f in upper for f in fragments):
            return label, tflops
    return None


def detect_card(device: torch.device, peak_tflops: float | None = None) -> Card:
    """The card's name and peak; ``peak_tflops`` (from the command line) overrides the table."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak_tflops is not None:
        return Card(device, name, peak_tflops * 1e12, "given with --peak-tflops")
    found = peak_for_name(name) if device.type == "cuda" else None
    if found is None:
        why = "CPU: no tensor-core peak" if device.type != "cuda" else f"{name!r} is not in the peak table"
        return Card(device, name, None, f"{why}; MFU not computed (pass --peak-tflops to set one)")
    label, tflops = found
    return Card(device, name, tflops * 1e12, f"{label}, dense bf16 from the vendor data sheet")


def sync(device: torch.device) -> None:
    """Wait for queued kernels: CUDA launches are asynchronous, so a timer must not stop before them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """Peak bytes the caching allocator handed out since the last reset (CUDA only; None on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """After a part (or an out-of-memory error): drop what is unreferenced so the next part starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Deadline:
    """A part's time budget: work is started only while an estimate of it still fits."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return time.monotonic() + seconds <= self.at
