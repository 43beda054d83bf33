"""Checkpoint saving side by side: the full format (rank 0 gathers and writes everything)
against the sharded format (every rank writes its pieces), synchronous and asynchronous.

Same model, data and ZeRO-3 layout on 4 CPU processes; a save every few steps. Measured:
the bytes the busiest rank writes, the seconds the step loop is blocked per save (the
median over saves of the slowest rank), and the whole fit's wall time. Ratios are taken
against the full format within this one run.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import WorkerFailed, first_error
from lightning_5d.testing import run_distributed

WORKER = Path(__file__).parent / "workers" / "checkpoint.py"
NPROC = 4
MODEL = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_layers": 6, "num_heads": 8,
         "num_kv_heads": 4}  # fmt: skip
MODES = [("full", "sync"), ("sharded", "sync"), ("sharded", "async")]


def _one(fmt: str, write: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = ["--format", fmt, "--write", write, "--steps", str(steps), "--save-every", "3",
                "--model", json.dumps(MODEL), "--dir", str(Path(tmp) / "ckpt"), "--out", str(out)]  # fmt: skip
        run = run_distributed(WORKER, NPROC, args, timeout=600)
        if run.returncode != 0 or not out.exists():
            raise WorkerFailed(first_error(run.output) or f"exit {run.returncode}", run.output)
        return json.loads(out.read_text())


def run(quick: bool) -> dict:
    steps = 9 if quick else 18
    rows = []
    for fmt, write in MODES:
        r = _one(fmt, write, steps)
        slowest = [max(times) for times in zip(*r["blocked_s"])]  # per save, the rank that waited longest
        rows.append({"format": fmt, "write": write, "fit_s": r["fit_s"], "blocked_s": statistics.median(slowest),
                     "max_rank_bytes": max(r["bytes_per_rank"]), "bytes_per_rank": r["bytes_per_rank"],
                     "saves": r["saves"]})  # fmt: skip
    return {"command": "python -m benchmarks run --only checkpoint_save" + (" --quick" if quick else ""),
            "steps": steps, "nproc": NPROC, "model": MODEL, "rows": rows}  # fmt: skip


def markdown(result: dict) -> str:
    full = result["rows"][0]
    lines = [
        f"Reference model {result['model']}, {result['nproc']} CPU processes, ZeRO-3, {result['steps']} steps, a "
        f"save every 3 steps (model + AdamW state). Blocked: the median over saves of the slowest rank's time "
        f"inside `save_checkpoint`; bytes: what the busiest rank wrote for one checkpoint.",
        "",
        "| format | write | blocked per save | vs full | busiest rank writes | vs full | fit wall time | vs full |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['format']} | {r['write']} | {r['blocked_s'] * 1e3:.0f} ms "
            f"| {r['blocked_s'] / full['blocked_s']:.2f}× "
            f"| {r['max_rank_bytes'] / 2**20:.1f} MiB | {r['max_rank_bytes'] / full['max_rank_bytes']:.2f}× "
            f"| {r['fit_s']:.1f} s | {r['fit_s'] / full['fit_s']:.2f}× |"
        )
    return "\n".join(lines)
