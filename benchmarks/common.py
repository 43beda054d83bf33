"""Shared by the benchmarks: start the training worker on N processes, medians, formatting."""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Sequence

from lightning_5d.testing import run_distributed

WORKER = Path(__file__).parent / "workers" / "train.py"

# Dimensions whose benchmarks wait for their implementation (issue numbers of the tracker).
PENDING = {"cp": 5, "pp": 6, "ep": 7}


class WorkerFailed(RuntimeError):
    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output  # the run's whole console output, for the report of a real failure


def run_worker(nproc: int, args: Sequence[str], timeout: float = 300.0) -> dict:
    """One training run of ``benchmarks/workers/train.py``; its JSON result (rank 0's view of all ranks).

    No retry: a crash is a finding, not noise to average away.
    """
    return _run_once(nproc, args, timeout)


def _run_once(nproc: int, args: Sequence[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run = run_distributed(WORKER, nproc, [*args, "--out", str(out)], timeout=timeout)
        if run.timed_out or run.returncode != 0 or not out.exists():
            reason = first_error(run.output) or f"exit {run.returncode}, timed out: {run.timed_out}"
            if not first_error(run.output):  # no Python exception: say what the ranks printed last
                reason += "; output tail:\n" + "\n".join(_tail(run.output))
            raise WorkerFailed(reason, run.output)
        return json.loads(out.read_text())


def _tail(output: str, lines: int = 25) -> list[str]:
    return [line for line in output.splitlines() if "Warning" not in line and line.strip()][-lines:]


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def first_error(output: str) -> str | None:
    """The first exception a rank printed (``SomeError: message``), launcher errors excluded."""
    for line in output.splitlines():
        m = _EXCEPTION_LINE.match(line.strip())
        if m and m.group(1) != "ChildFailedError":
            return f"{m.group(1)}: {m.group(2)}"
    return None


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def pending_note(dim: str) -> str:
    return f"pending: dimension not landed (issue {PENDING[dim]})"


def fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def results_section(name: str, result: dict) -> list[str]:
    """One benchmark's section of RESULTS.md: heading, command, machine, date, wall time, its markdown."""
    meta = [f"- command: `{result['command']}`", f"- machine: {result['machine']}", f"- date: {result['date']}"]
    if "elapsed_s" in result:
        meta.append(f"- wall time: {result['elapsed_s']:.0f} s; load average at start: {result['load_average']}")
    return [f"## {name}", "", *meta, "", result["markdown"], ""]
