"""Text tables and JSON for estimates and plans. JSON keys are stable (docs/planner.md lists them)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .estimator import Estimate
from .search import PlanEntry


def _size(n: float) -> str:
    """Binary units, as memory is reported (GiB = 2^30)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_estimate(est: Estimate) -> str:
    s, mem = est.setup, est.memory.gib()
    lines = [
        f"model       {est.spec.name}: {_count(est.params.total)} params"
        + (
            f" ({_count(est.params.active)} active per token)"
            if est.params.active != est.params.total
            else ""
        ),
        f"layout      {s.describe()}  ->  {s.world_size} GPUs, global batch {s.global_batch} x {s.seq_len} tokens",
        f"FLOPs/step  model {est.flops.model_per_step:.3e}  hardware {est.flops.hardware_per_step:.3e}  "
        f"(per token {est.flops.model_per_token:.3e})",
        f"memory      most loaded rank: pp stage {est.memory.stage.value} (GiB)",
    ]
    for key in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        lines.append(f"  {key:<12}{mem[key]:>10.2f}")
    lines.append("comm/step   bytes sent per rank (ring)")
    lines.append(
        f"  {'dim':<4}{'collective':<16}{'group':>6}{'calls':>8}{'per call':>12}{'total':>12}  {'link':<11}what"
    )
    for c in est.comm:
        lines.append(
            f"  {c.dim:<4}{c.collective.value:<16}{c.group_size:>6}{c.calls:>8}{_size(c.bytes_per_call):>12}"
            f"{_size(c.bytes_per_rank):>12}  {c.link.value:<11}{c.what}"
        )
    if not est.comm:
        lines.append("  (none: a single rank)")
    totals = est.comm_bytes_per_step
    lines.append(
        "  by dim: " + ", ".join(f"{d} {_size(v)}" for d, v in totals.items() if v) if totals["total"] else ""
    )
    lines.append(
        f"bubble      {100 * est.bubble_fraction:.2f}% of the step ({est.bubble_relative:.4f} x ideal compute)"
    )
    return "\n".join(line for line in lines if line)


def format_plan(entries: Sequence[PlanEntry]) -> str:
    header = f"{'#':>3}  {'layout':<58}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>6}{'mem GiB':>9}{'bubble':>8}"
    lines = [header, "-" * len(header)]
    for e in entries:
        lines.append(
            f"{e.rank:>3}  {e.setup.describe():<58}{e.time.total:>9.3f}"
            f"{e.estimate.flops.tokens_per_step / e.time.total / e.setup.world_size:>11.0f}"
            f"{100 * e.time.predicted_mfu:>5.0f}%"
            f"{e.estimate.memory.total / 2**30:>9.1f}{100 * e.estimate.bubble_fraction:>7.1f}%"
        )
        lines.append(f"     why: {e.why}")
    if len(entries) > 1 and entries[0].ahead_because:
        lines.append("-" * len(header))
        lines.append(f"#1 beats #2 on {entries[0].ahead_because}")
    return "\n".join(lines)


def estimate_json(est: Estimate) -> str:
    return json.dumps(est.to_dict(), indent=2, sort_keys=False)


def plan_json(entries: Sequence[PlanEntry]) -> str:
    return json.dumps({"plan": [e.to_dict() for e in entries]}, indent=2)
