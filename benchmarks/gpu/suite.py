"""The one-GPU suite: four parts in one process, each within its time budget, each failure contained.

``run_suite`` measures the parts in order (overhead and MFU, FP8 vs bf16, attention kernels, memory
vs the planner), resets the CUDA peak-memory counter before each, and after each part rewrites
``gpu.json`` (every raw number) and ``gpu.md`` (the RESULTS.md section) in the output folder, so a
run killed at its time limit keeps what it measured. A part that raises records its error and the
next part runs. ``--dry`` runs the same code on the CPU with a tiny model in seconds: it checks the
script, its numbers mean nothing.

Also the ``python -m benchmarks run`` entry (``run``/``markdown``) under the name ``gpu``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.common import results_section
from benchmarks.gpu import attention, fp8_speed, memory, overhead
from benchmarks.gpu.hardware import Card, Deadline, detect_card, release_memory, reset_peak
from benchmarks.gpu.part import PartContext
from benchmarks.gpu.workload import DRY, FULL, Sizes

NAME = "gpu"  # the section in RESULTS.md and the key in results.json
DEFAULT_BUDGET_S = 480.0  # the issue's ~8 minutes, inside the device's 10-minute limit per command
JSON_FILE, MARKDOWN_FILE = "gpu.json", "gpu.md"


class NoGpuError(RuntimeError):
    pass


# name -> (title, measure, markdown)
PARTS: dict[str, tuple[str, Callable[[PartContext], dict], Callable[[dict, Sizes, Card], list[str]]]] = {
    "overhead": ("1. Overhead and MFU: FiveDStrategy vs a plain PyTorch loop", overhead.measure, overhead.markdown),
    "fp8": ("2. FP8 (torch-native backend) vs bf16", fp8_speed.measure, fp8_speed.markdown),
    "attention": ("3. Attention kernels of context parallelism vs SDPA", attention.measure, attention.markdown),
    "memory": ("4. Memory vs the planner", memory.measure, memory.markdown),
}


def choose_device(dry: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if not dry:
        raise NoGpuError(
            "the GPU suite needs a CUDA GPU (torch.cuda.is_available() is False here). Run it on a GPU machine "
            "(benchmarks/README.md: prepare here, run there), or add --dry to check the script on CPU."
        )
    return torch.device("cpu")


def machine(card: Card) -> str:
    cuda = f", CUDA {torch.version.cuda}" if card.device.type == "cuda" else ""
    return (f"{card.name}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}{cuda}")  # fmt: skip


def _quiet_lightning() -> None:
    # Every fit prints its device and layout lines; one per part is noise in a 12 KB console tail.
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_5d"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_suite(
    out: Path,
    *,
    dry: bool,
    command: str,
    budget_s: float = DEFAULT_BUDGET_S,
    only: tuple[str, ...] = tuple(PARTS),
    sizes: Sizes | None = None,
    peak_tflops: float | None = None,
    fp8_recipes: tuple[str, ...] = fp8_speed.DEFAULT_RECIPES,
) -> dict[str, Any]:
    """Measure ``only`` (in the suite's order), write ``gpu.json`` and ``gpu.md`` into ``out``; the result."""
    started = time.perf_counter()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    device = choose_device(dry)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The dry run checks code paths, not speed; on a shared CPU, OpenMP threads spin-waiting for a
        # core cost more than they give (tens of ms per tiny FP8 GEMM against a fraction of one).
        torch.set_num_threads(1)
    sizes = sizes or (DRY if dry else FULL)
    card = detect_card(device, peak_tflops)
    out.mkdir(parents=True, exist_ok=True)
    _quiet_lightning()
    skipped = fp8_speed.skipped(fp8_recipes) if "fp8" in only else []
    skipped += [f"part {PARTS[name][0]}: not asked for (--only)" for name in PARTS if name not in only]
    result: dict[str, Any] = {
        "command": command, "machine": machine(card), "date": dt.date.today().isoformat(), "load_average": load,
        "mode": sizes.mode, "card": card.as_dict(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "sizes": sizes.as_dict(), "fp8_recipes": list(fp8_recipes), "budget_s": budget_s, "skipped": skipped,
        "parts": {},
    }  # fmt: skip
    owns_group = not (dist.is_available() and dist.is_initialized())
    total = Deadline(budget_s)
    try:
        for name in [n for n in PARTS if n in only]:
            ctx = PartContext(sizes, card, Deadline(min(sizes.budgets[name], total.left())), out, fp8_recipes)
            t0 = time.perf_counter()
            reset_peak(device)
            try:
                part = PARTS[name][1](ctx)
            except Exception as err:  # one part's failure must not cost the others their numbers
                part = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            part["elapsed_s"] = time.perf_counter() - t0
            result["parts"][name] = part
            release_memory(device)
            result["elapsed_s"] = time.perf_counter() - started
            write(result, out, sizes, card)
    finally:
        torch.set_num_threads(threads)
        if owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # the Trainers made it; a caller that had none gets none back
    return result


def write(result: dict[str, Any], out: Path, sizes: Sizes, card: Card) -> None:
    result["markdown"] = markdown_body(result, sizes, card)
    (out / JSON_FILE).write_text(json.dumps(result, indent=2) + "\n")
    (out / MARKDOWN_FILE).write_text("\n".join(results_section(NAME, result)))


def markdown_body(result: dict[str, Any], sizes: Sizes, card: Card) -> str:
    peak = f"{card.peak_flops / 1e12:.0f} TFLOP/s ({card.peak_source})" if card.peak_flops else card.peak_source
    lines = [
        f"Card: {card.name}; peak: {peak}; torch {result['torch']}. The parts run one after another in one process, "
        f"each within its time budget ({result['budget_s']:.0f} s in all), the CUDA peak-memory counter reset "
        "before each.",
    ]
    if result["mode"] == "dry":
        lines += ["", "**Dry run** on CPU with a tiny model: it checks that every step of the suite works; its "
                  "speeds and memory figures mean nothing."]  # fmt: skip
    if result["skipped"]:
        lines += ["", "Skipped:", *[f"- {line}" for line in result["skipped"]]]
    for name, part in result["parts"].items():
        title, _, render = PARTS[name]
        lines += ["", f"### {title}", ""]
        if "error" in part:
            lines += [f"**Failed** after {part['elapsed_s']:.0f} s: `{part['error'].splitlines()[0]}` "
                      f"(traceback in {JSON_FILE})."]  # fmt: skip
        else:
            lines += render(part, sizes, card)
    return "\n".join(lines)


# --------------------------------------------------------------------------- `python -m benchmarks run` entry
def run(quick: bool) -> dict:
    """Measures on a CUDA machine; elsewhere records that it did not run (``--dry`` is the CPU check)."""
    command = "python -m benchmarks.gpu run --out DIR"
    if not torch.cuda.is_available():
        return {"command": command, "status": "not run: no CUDA GPU on this machine (benchmarks/README.md: "
                "prepare the wheels here, run the suite on a GPU machine)"}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        return run_suite(Path(tmp), dry=False, command=command)


def markdown(result: dict) -> str:
    if "status" in result:
        return (f"**{result['status']}.** When run it measures, on one GPU: FiveDStrategy vs a plain loop (tokens/s, "
                "MFU) on a ~1B model, FP8 recipes vs bf16, the context-parallel block kernel vs SDPA, memory vs "
                "the planner.")  # fmt: skip
    return result["markdown"]
