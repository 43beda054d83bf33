"""Capacity: the longest sequence that trains within a fixed memory cap per process, at cp = 1, 2, 4.

Context parallelism exists to make a sequence that does not fit one process fit several;
with every per-token tensor cut S/cp ways, the longest trainable S should grow ~cp×.

Model: ``LlamaLM`` hidden 256, 2 layers, 8 heads / 4 KV heads, vocab 256; fp32, AdamW,
``FiveDStrategy(zero=1)``, gloo, 1 thread per process; one sequence per step (micro-batch 1,
one data rank); cp=C runs C processes, ``context={"mode": "ring", "sharding": "zigzag"}``.

The cap is on what training adds to a process: its peak RSS during ``fit`` minus its RSS just
before ``fit`` (the interpreter, torch and Lightning, ~380 MiB, are the same at every S and
cp), the largest rank, with glibc's allocator pinned (``MALLOC_MMAP_THRESHOLD_=65536``: freed
blocks above 64 KiB go back to the OS at once, so RSS follows the live tensors). One probe =
one run of ``benchmarks/workers/train.py`` at one S: 2 warm-up steps + 1 (the optimizer
state exists from the first step; the peak is the steady step's).

Why measured, not enforced: ``resource.setrlimit(RLIMIT_DATA)`` does work with torch on this
machine (an allocation past it raises in the allocator), but it caps *virtual* data, and gloo
reserves far more than it touches (measured: joining a 2-rank gloo group adds ~28 MiB of
VmData for ~7 MiB of RSS). A data limit would charge every extra rank for address space it
never uses, and a rank failing an allocation in the middle of the ring leaves its peers
waiting on it. RSS is what a process really holds.

Search per cp, on a grid of ``GRID`` tokens: two probes at S = 1024·cp and 2048·cp give a
linear fit growth(S) = base + slope·S; its prediction for the cap, rounded down to the grid,
is probed, then S moves one grid step at a time (up while it fits, down while it does not)
until one probe fits and the next grid point up does not. S_max is that measured boundary;
the fit only chooses where to start looking.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.common import WORKER, WorkerFailed, first_error
from lightning_5d.testing import run_distributed

MODEL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_layers": 2, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
CAP_MIB = 160  # peak RSS growth during fit, per process (sized so that cp=4's probes run in minutes on 2 cores)
GRID = 256  # tokens: S_max is found to this resolution (divisible by 2·cp for the zig-zag cut)
CPS = (1, 2, 4)
# --quick: half the cap (shorter sequences, so each probe is ~4x cheaper) and cp = 1, 2 only;
# the ratio it reports is the same quantity, measured on a smaller memory budget.
QUICK_CAP_MIB = 80
QUICK_CPS = (1, 2)
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MAX_PROBES = 12  # per cp: a search that has not converged by then reports what it has
COMMAND = "python -m benchmarks run --only context_parallel_capacity"


def _probe(cp: int, seq_len: int, cap_mib: int) -> dict:
    """One training run at (cp, S) with the allocator pinned: the ranks' RSS growth during fit."""
    cfg = {**MODEL, "max_seq_len": seq_len}
    args = ["--strategy", "5d", "--zero", "1", "--model", json.dumps(cfg), "--seq-len", str(seq_len),
            "--batch-size", "1", "--warmup", "2", "--steps", "1"]  # fmt: skip
    if cp > 1:
        args += ["--cp", str(cp), "--cp-mode", "ring", "--cp-sharding", "zigzag"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run = run_distributed(WORKER, cp, [*args, "--out", str(out)], timeout=1200, env=PINNED_MALLOC)
        if run.timed_out or run.returncode != 0 or not out.exists():
            raise WorkerFailed(first_error(run.output) or f"exit {run.returncode}, timed out: {run.timed_out}",
                               run.output)  # fmt: skip
        result = json.loads(out.read_text())
    growth = [r["peak_rss_bytes"] - r["rss_before_fit_bytes"] for r in result["ranks"]]
    return {
        "seq_len": seq_len,
        "growth_bytes": max(growth),
        "growth_ranks": growth,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in result["ranks"]),
        "step_s": result["step_s"],
        "loss": result["ranks"][0]["losses"][-1],
        "fits": max(growth) <= cap_mib * 2**20,
    }


def _search(cp: int, cap_mib: int) -> dict:
    probes: dict[int, dict] = {}

    def probe(s: int) -> dict:
        if s not in probes:
            probes[s] = _probe(cp, s, cap_mib)
            p = probes[s]
            print(f"[capacity] cp={cp} S={s}: growth {p['growth_bytes'] / 2**20:.1f} MiB, fits {p['fits']}", flush=True)
        return probes[s]

    a, b = probe(1024 * cp), probe(2048 * cp)
    slope = (b["growth_bytes"] - a["growth_bytes"]) / (b["seq_len"] - a["seq_len"])
    base = a["growth_bytes"] - slope * a["seq_len"]
    guess = max(GRID, int((cap_mib * 2**20 - base) / slope) // GRID * GRID) if slope > 0 else b["seq_len"]
    s = guess
    while len(probes) < MAX_PROBES:
        if probe(s)["fits"]:
            if not probe(s + GRID)["fits"]:
                break
            s += GRID
        else:
            if s - GRID < GRID:
                s = 0
                break
            s -= GRID
    converged = s > 0 and probes.get(s, {}).get("fits") and s + GRID in probes and not probes[s + GRID]["fits"]
    return {
        "cp": cp,
        "s_max": s,
        "converged": bool(converged),
        "fit": {"base_bytes": base, "bytes_per_token": slope, "guess": guess},
        "probes": [probes[k] for k in sorted(probes)],
    }


def run(quick: bool) -> dict:
    cap_mib, cps = (QUICK_CAP_MIB, QUICK_CPS) if quick else (CAP_MIB, CPS)
    load = [os.getloadavg()[0]]
    rows = {str(cp): _search(cp, cap_mib) for cp in cps}
    load.append(os.getloadavg()[0])
    return {"command": COMMAND, "model": MODEL, "cap_mib": cap_mib, "grid": GRID, "rows": rows, "load_1min": load}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def markdown(result: dict) -> str:
    rows, grid, cap = result["rows"], result["grid"], result["cap_mib"]
    m = result["model"]
    one = rows["1"]["s_max"]
    lines = [
        f"`LlamaLM` hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads / "
        f"{m['num_kv_heads']} KV heads, vocab {m['vocab_size']}; fp32, AdamW, `FiveDStrategy(zero=1)`, gloo, 1 thread "
        f"per process, one sequence per step; cp = C on C processes, `context={{\"mode\": \"ring\", \"sharding\": "
        f"\"zigzag\"}}` (cp=4: 4 processes on the 2 cores; memory does not depend on the timing). Cap: peak RSS "
        f"growth during `fit` ≤ {cap} MiB per process (largest rank; the ~380 MiB the interpreter, torch and "
        f"Lightning hold before `fit` are the same in every run and not counted), allocator pinned "
        f"(`MALLOC_MMAP_THRESHOLD_=65536`). S_max: the longest S on a {grid}-token grid whose run stayed under the "
        f"cap, with S_max + {grid} measured over it (a linear fit of two probes picks where to start; every S in the "
        f"table was run). Measured RSS, not an enforced limit: `RLIMIT_DATA` works with torch here, but counts "
        f"the virtual memory gloo reserves (~28 MiB of VmData for ~7 MiB of RSS per 2-rank group) and would charge "
        f"every extra rank for address space it never touches. Load average (1 min) at start and end: "
        f"{', '.join(f'{x:.1f}' for x in result['load_1min'])}.",
        "",
        f"| cp | processes | S_max | S_max / S_max(cp=1) | growth at S_max (MiB) | growth at S_max + {grid} (MiB) "
        "| fitted MiB per 1K tokens | fitted base (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cp, row in rows.items():
        by_s = {p["seq_len"]: p for p in row["probes"]}
        s = row["s_max"]
        at, above = by_s.get(s), by_s.get(s + grid)
        mark = "" if row["converged"] else " (search did not converge)"
        lines.append(
            f"| {cp} | {cp} | {s:,}{mark} | {s / one:.2f} | {_mib(at['growth_bytes']) if at else '–'} "
            f"| {_mib(above['growth_bytes']) if above else '–'} | {row['fit']['bytes_per_token'] * 1024 / 2**20:.1f} "
            f"| {_mib(row['fit']['base_bytes'])} |"
        )
    lines += ["", "Every probe (S: peak RSS growth per process in MiB, ✓ under the cap):", ""]
    for cp, row in rows.items():
        probes = ", ".join(f"{p['seq_len']:,}: {_mib(p['growth_bytes'])} {'✓' if p['fits'] else '✗'}"
                           for p in row["probes"])  # fmt: skip
        lines.append(f"- cp={cp}: {probes}")
    lines += ["", _explain(result)]
    return "\n".join(lines)


def _explain(result: dict) -> str:
    """Where S_max / S_max(cp=1) stands against cp, from the fits of this run."""
    rows = result["rows"]
    one = rows["1"]
    cap = result["cap_mib"] * 2**20
    parts = []
    for cp, row in rows.items():
        if cp == "1":
            continue
        slope = row["fit"]["bytes_per_token"] / one["fit"]["bytes_per_token"]
        # S_max ≈ (cap − base) / slope per cp: the ratio splits into a slope part and a base part.
        predicted = (cap - row["fit"]["base_bytes"]) / (cap - one["fit"]["base_bytes"]) / slope
        parts.append(f"cp={cp}: S_max ratio {row['s_max'] / one['s_max']:.2f}, per-token slope {slope:.3f}× cp=1's "
                     f"(ideal {1 / int(cp):.3f}), base {_mib(row['fit']['base_bytes'])} MiB, the fit's ratio "
                     f"{predicted:.2f}")  # fmt: skip
    return (f"Against cp: the per-token part of a process's growth falls as 1/cp; the base (what a process "
            f"holds before its first token; cp=1: {_mib(one['fit']['base_bytes'])} MiB) moves both ways with cp — "
            f"parameters and gradients stay whole on every rank and gloo groups come with each rank, while "
            f"ZeRO-1 shards the optimizer state over dp×cp, so with more cp ranks each holds less of it. A base "
            f"below cp=1's lets the ratio exceed cp. " + "; ".join(parts) + ".")  # fmt: skip


def _main() -> None:
    """``python -m benchmarks.context_parallel_capacity``: this section alone, as ``run --only`` does it."""
    from benchmarks.__main__ import main

    main(["run", "--only", "context_parallel_capacity"])


if __name__ == "__main__":
    _main()
