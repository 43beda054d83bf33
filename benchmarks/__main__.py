"""`python -m benchmarks run [--quick] [--only NAME ...]`: run, then write RESULTS.md and results.json.

Results of benchmarks not run this time are kept from results.json, so `--only` refreshes
one section without losing the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import (
    checkpoint_save,
    comm_vs_theory,
    context_parallel_capacity,
    context_parallel_scaling,
    cp_bytes_vs_theory,
    memory_vs_theory,
    overhead_vs_lightning,
    pipeline_bubble,
    precision_recipes,
    startup_memory,
    startup_memory_load,
)
from benchmarks.common import results_section
from benchmarks.gpu import suite as gpu_suite

# In the order RESULTS.md shows them.
BENCHMARKS = {
    "overhead_vs_lightning": overhead_vs_lightning,
    "comm_vs_theory": comm_vs_theory,
    "memory_vs_theory": memory_vs_theory,
    "pipeline_bubble": pipeline_bubble,
    "context_parallel_scaling": context_parallel_scaling,
    "context_parallel_capacity": context_parallel_capacity,
    "cp_bytes_vs_theory": cp_bytes_vs_theory,
    "precision_recipes": precision_recipes,
    "checkpoint_save": checkpoint_save,
    "startup_memory": startup_memory,
    "startup_memory_load": startup_memory_load,
    "gpu": gpu_suite,
}
HERE = Path(__file__).parent

HOW_TO_RUN = """\
## How to run

```bash
python -m benchmarks run --quick                          # every benchmark, fewer repeats/steps (CPU, < 15 min)
python -m benchmarks run                                  # the full run (more repeats and timed steps)
python -m benchmarks run --only comm_vs_theory            # one section; the others are kept from results.json
python -m benchmarks.gpu run --out DIR                    # the one-GPU suite (benchmarks/README.md: prepare, run)
```

Each run rewrites its sections of this file and `results.json` (every raw number, per rank and per
repeat); text added by hand (notes, reruns, sections measured by hand) is kept.
Multi-process benchmarks start their workers with `torch.distributed.run` (gloo, 1 thread per
process) through `lightning_5d.testing.run_distributed`, which kills a hung run. Timings on a
machine shared with other work are noisy: compare ratios taken within one run, not absolute
numbers across runs; the load average at the start of each benchmark is recorded below.
"""


def machine() -> str:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}, "
            f"torch {torch.__version__}")  # fmt: skip


def render(results: dict) -> str:
    sections = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks run`; raw numbers in `results.json`. A ✗ marks a ratio that misses "
        "its target; each miss is explained next to it.",
        "",
        HOW_TO_RUN,
    ]
    for name in [n for n in BENCHMARKS if n in results] + sorted(set(results) - set(BENCHMARKS)):
        sections += results_section(name, results[name])
    return "\n".join(sections)


KEPT = "Kept from the previous RESULTS.md (edited by hand since it was generated, or measured by hand):"


def updated(text: str, name: str, old: dict | None, new: dict) -> str:
    """RESULTS.md ``text`` with ``name``'s generated section made ``new``'s.

    Where the previous run's generated text (``old``'s) is still there word for word, it is replaced
    in place. Where it is not (notes, tables and reruns added by hand inside the section), the new
    section goes in front and the old text stays under it. Sections and notes no run generates
    (measured by hand: verify_cost, training_patterns, ...) are never touched, so a rerun of one
    benchmark loses no recorded number."""
    fresh = "\n".join(results_section(name, new))
    if old is not None:
        before = "\n".join(results_section(name, old))
        if before in text:
            return text.replace(before, fresh, 1)
    heading = f"## {name}\n"
    found = text.find("\n" + heading)
    at = 0 if text.startswith(heading) else found + 1 if found >= 0 else -1
    if at >= 0:
        return text[:at] + fresh + "\n" + KEPT + "\n\n" + text[at + len(heading) :].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + fresh + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument("--only", nargs="*", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    args = parser.parse_args(argv)
    results = json.loads((HERE / "results.json").read_text()) if (HERE / "results.json").exists() else {}
    previous = dict(results)
    report = HERE / "RESULTS.md"
    text = report.read_text() if report.exists() else render(results)
    started = time.perf_counter()
    for name in args.only:
        print(f"[benchmarks] {name} ...", flush=True)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        t0 = time.perf_counter()
        result = BENCHMARKS[name].run(args.quick)
        result["elapsed_s"] = time.perf_counter() - t0
        result["load_average"] = load
        result["quick"] = args.quick
        result["date"] = dt.date.today().isoformat()
        result["machine"] = machine()
        result["markdown"] = BENCHMARKS[name].markdown(result)
        results[name] = result
        print(f"[benchmarks] {name}: {result['elapsed_s']:.0f} s", flush=True)
        # Written after every benchmark, so an interrupted run keeps what it measured.
        (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        text = updated(text, name, previous.get(name), result)
        report.write_text(text)
    print(f"[benchmarks] total: {time.perf_counter() - started:.0f} s", flush=True)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
