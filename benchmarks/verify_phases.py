"""Where the plan verifier's memory goes: resident memory around each of its steps, per piece.

Used by ``python -m benchmarks.verify_cost --trace`` (rank 0 of each case). Torch's CPU tensors
are allocated outside Python's allocator, so ``tracemalloc`` does not see them; this reads the
kernel's counters instead: ``VmRSS`` (resident now) and ``VmHWM`` (the high-water mark, reset to
the current RSS through ``/proc/self/clear_refs`` before each step, so each step gets its own
peak). The steps are the verifier's functions, wrapped where ``check.py`` / ``rerun.py`` call
them (nothing in the package changes):

* ``probe``: the probe forward of the whole parallel model;
* ``compare``: one piece, everything below included;
* ``parallel grads``: the live piece run again and its backward (``ParallelGrads.of``);
* ``weights``: the piece's full weights gathered (``full_weights``);
* ``reference``: the unparallelized piece given those weights (``materialize``);
* ``reference grads``: its backward (``reference_grads``).

The rise of a step is its peak minus the RSS it started at; the rank's share is the RSS
before the verifier.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

_STATUS = Path("/proc/self/status")


def _counters() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    values = {}
    for line in _STATUS.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS


class PhaseTrace:
    """The verifier's steps on this rank, each with the RSS it started at, its peak and its end."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.piece = ""
        self._open: list[dict[str, Any]] = []  # the steps running now, outermost first

    def _enter(self, phase: str) -> dict[str, Any]:
        rss, peak = _counters()
        for frame in self._open:  # the peak so far counts for every enclosing step before the reset
            frame["peak_mib"] = max(frame["peak_mib"], peak)
        _reset_peak()
        frame = {"piece": self.piece, "phase": phase, "depth": len(self._open), "start_mib": rss, "peak_mib": rss}
        self._open.append(frame)
        return frame

    def _leave(self) -> None:
        rss, peak = _counters()
        frame = self._open.pop()
        frame["peak_mib"] = max(frame["peak_mib"], peak)
        frame["end_mib"] = rss
        for outer in self._open:
            outer["peak_mib"] = max(outer["peak_mib"], frame["peak_mib"])
        self.rows.append(frame)

    def wrap(self, owner: Any, name: str, phase: str, piece_arg: int | None = None) -> None:
        original: Callable = getattr(owner, name)

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if piece_arg is not None:
                self.piece = getattr(args[piece_arg], "path", str(args[piece_arg]))
            self._enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._leave()

        setattr(owner, name, traced)

    def install(self) -> None:
        from lightning_5d.verify import check, rerun

        self.wrap(check, "run_probe", "probe")
        self.wrap(check.PlanCheck, "_compare", "compare", piece_arg=1)
        self.wrap(rerun.ParallelGrads, "of", "parallel grads")
        self.wrap(check, "full_weights", "weights")
        self.wrap(check, "materialize", "reference")
        self.wrap(check, "reference_grads", "reference grads")

    def table(self, share_mib: float) -> list[dict[str, Any]]:
        """Each step with its rise over the share and over its own start."""
        return [{**row, "rise_mib": row["peak_mib"] - row["start_mib"], "over_share_mib": row["peak_mib"] - share_mib}
                for row in self.rows]  # fmt: skip


def dump(trace: PhaseTrace, share_mib: float, path: str) -> None:
    Path(path).write_text(json.dumps({"share_mib": share_mib, "rows": trace.table(share_mib)}))


def summary(data: dict[str, Any]) -> str:
    """The worst row of each step, then each piece's own steps (blocks: the worst block's)."""
    rows = data["rows"]
    share = data["share_mib"]
    by_phase: dict[str, dict[str, Any]] = {}
    for row in rows:
        best = by_phase.get(row["phase"])
        if best is None or row["over_share_mib"] > best["over_share_mib"]:
            by_phase[row["phase"]] = row
    lines = [f"share (RSS before the verifier): {share:.0f} MiB",
             "| step | worst piece | start over share | peak over share | rise in the step |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    for phase, row in by_phase.items():
        lines.append(f"| {phase} | {row['piece'] or '-'} | {row['start_mib'] - share:.0f} MiB | "
                     f"{row['over_share_mib']:.0f} MiB | {row['rise_mib']:.0f} MiB |")  # fmt: skip
    compares = [r for r in rows if r["phase"] == "compare"]
    blocks = [r for r in compares if ".layers." in f".{r['piece']}."]
    shown = [r for r in compares if r not in blocks]
    if blocks:
        shown.insert(1, max(blocks, key=lambda r: r["over_share_mib"]))
    lines += ["", "| piece | " + " | ".join(_STEPS) + " |", "|---|" + "---:|" * len(_STEPS)]
    for row in shown:
        peaks = {r["phase"]: r["over_share_mib"] for r in rows if r["piece"] == row["piece"]}
        cells = [f"{peaks[s]:.0f}" if s in peaks else "-" for s in _STEPS]
        lines.append(f"| {row['piece']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n(piece rows: each step's peak over the share, MiB)"


_STEPS = ("parallel grads", "weights", "reference", "reference grads", "compare")
