"""Drawings of a simulated pipeline schedule: a text grid, a PNG, and the ``l5d schedule`` command.

The timeline comes from :mod:`lightning_5d.parallel.pipeline.actions`, i.e. from the action lists
torch's schedule objects compute, so the picture is of the schedule the runtime runs. Each drawing
puts the simulated bubble next to the planner's closed form
(:func:`lightning_5d.estimate.schedule.bubble_fraction`), labelled, so a gap between them shows.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from fractions import Fraction
from typing import Any

from lightning_5d.config import SPLIT_BACKWARD, LayoutError, PipelineSchedule
from lightning_5d.estimate.schedule import bubble_fraction
from lightning_5d.parallel.pipeline.actions import (
    ActionCosts,
    ActionKind,
    Interval,
    ScheduleDeadlockError,
    Timeline,
    action_lists,
    simulate,
)
from lightning_5d.pipeline_shape import V_SHAPED, default_microbatches

PLOT_EXTRA = "pip install 'lightning_5d[plot]'"

# The planner's closed forms, in the fraction-of-step convention r/(1+r) bubble_fraction returns.
FORMULAS = {
    PipelineSchedule.AFAB: "GPipe (p-1)/(m+p-1)",
    PipelineSchedule.ONE_F_ONE_B: "1F1B (p-1)/(m+p-1)",
    PipelineSchedule.INTERLEAVED_1F1B: "interleaved 1F1B (p-1)/(v*m+p-1)",
    PipelineSchedule.ZERO_BUBBLE: "ZB-H1 (p-1)/(3m+p-1)",
    PipelineSchedule.ZBV: "ZB-V (p-1)/(6m+p-1)",
    PipelineSchedule.DUALPIPEV: "DualPipeV (p-2)/(6m+p-2)",
}
KIND_NAMES = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "full backward (input + weight grads)",
    ActionKind.BACKWARD_INPUT: "input-grad backward",
    ActionKind.BACKWARD_WEIGHT: "weight-grad backward",
}
_MICROBATCH_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_TEXT_COLUMNS = 400  # beyond this a cell covers more than one time unit


# ---------------------------------------------------------------------------------------- figures


def bubble_lines(timeline: Timeline, schedule: PipelineSchedule | str | None) -> list[str]:
    """The simulated bubble and, given the schedule, the formula's, each with its label."""
    lines = [f"bubble, simulated (idle / (ranks x makespan)): {timeline.bubble_fraction():.2%}"]
    if schedule is not None:
        schedule = PipelineSchedule(schedule)
        p, m, v = _sizes(timeline)
        formula = bubble_fraction(p, m, v, schedule)
        note = ""
        costs = timeline.costs
        if schedule in SPLIT_BACKWARD and not costs.forward == costs.backward_input == costs.backward_weight:
            note = "; it assumes F = I = W, these costs differ"
        lines.append(f"bubble, formula ({FORMULAS[schedule]}{note}): {formula:.2%}")
    return lines


def _sizes(timeline: Timeline) -> tuple[int, int, int]:
    p = timeline.ranks
    return p, timeline.microbatches, max(1, timeline.num_stages // p)


def _costs_text(costs: ActionCosts) -> str:
    full = costs.backward_input + costs.backward_weight
    return f"F={costs.forward:g} I={costs.backward_input:g} W={costs.backward_weight:g} (B=I+W={full:g})"


# ---------------------------------------------------------------------------------------- text


def render_text(timeline: Timeline, schedule: PipelineSchedule | str | None = None) -> str:
    """One row per rank, one column per time unit: kind letter + microbatch, '..' where the rank idles."""
    schedule = PipelineSchedule(schedule) if schedule is not None else None
    p, m, v = _sizes(timeline)
    unit = _time_unit(timeline)
    columns = math.ceil(timeline.makespan / unit - 1e-9)
    mb_width = 1 if m <= len(_MICROBATCH_CHARS) else len(str(m - 1))
    cell = 1 + mb_width
    labels = {rank: f"rank {rank} (stage {','.join(map(str, timeline.stages_on(rank)))})" for rank in range(p)}
    label_width = max(len(label) for label in labels.values()) + 1
    head = f"{schedule.value if schedule is not None else 'schedule'}: pp={p} microbatches={m}"
    if v > 1:
        head += f" virtual_stages={v}"
    lines = [f"{head}  costs {_costs_text(timeline.costs)}  one column = {unit:g} time unit{'' if unit == 1 else 's'}"]
    lines.append(" " * label_width + _time_ruler(columns, cell, unit))
    for rank in range(p):
        row = _text_row(timeline, rank, columns, unit, mb_width)
        lines.append(f"{labels[rank]:<{label_width}}{row}")
    lines.append("")
    lines.extend(_legend_lines(timeline, m))
    lines.append("")
    lines.append(f"makespan: {timeline.makespan:g} time units")
    lines.extend(bubble_lines(timeline, schedule))
    lines.append(f"peak microbatches in flight on stage 0: {timeline.peak_in_flight(0)}")
    return "\n".join(lines)


def _time_unit(timeline: Timeline) -> float:
    """The largest step every action time is a multiple of, widened if the row would be too long."""
    costs = timeline.costs
    step = Fraction(0)
    for value in (costs.forward, costs.backward_input, costs.backward_weight):
        step = _fraction_gcd(step, Fraction(value).limit_denominator(1000))
    unit = float(step) if step > 0 else 1.0
    return max(unit, timeline.makespan / MAX_TEXT_COLUMNS)


def _fraction_gcd(a: Fraction, b: Fraction) -> Fraction:
    denominator = a.denominator * b.denominator // math.gcd(a.denominator, b.denominator)
    return Fraction(math.gcd(int(a * denominator), int(b * denominator)), denominator)


def _time_ruler(columns: int, cell: int, unit: float) -> str:
    ruler = [" "] * (columns * cell)
    for col in range(0, columns, 5):
        mark = f"|{col * unit:g}"
        start = col * cell
        if start + len(mark) <= len(ruler):  # a cut-off number would misread
            ruler[start : start + len(mark)] = mark
    return "".join(ruler).rstrip()


def _text_row(timeline: Timeline, rank: int, columns: int, unit: float, mb_width: int) -> str:
    chunk_of = {stage: i for i, stage in enumerate(timeline.stages_on(rank))}
    intervals = list(timeline.intervals[rank])
    cells, i = [], 0
    for col in range(columns):
        middle = (col + 0.5) * unit
        while i < len(intervals) and intervals[i].end <= middle:
            i += 1
        if i < len(intervals) and intervals[i].start <= middle:
            cells.append(_text_cell(intervals[i], chunk_of, mb_width))
        else:
            cells.append("." * (1 + mb_width))
    return "".join(cells)


def _text_cell(interval: Interval, chunk_of: dict[int, int], mb_width: int) -> str:
    action = interval.action
    letter = action.kind.value if chunk_of[action.stage] % 2 == 0 else action.kind.value.lower()
    if mb_width == 1:
        return letter + _MICROBATCH_CHARS[action.microbatch]
    return letter + str(action.microbatch).rjust(mb_width)


def _legend_lines(timeline: Timeline, m: int) -> list[str]:
    kinds = [k for k in ActionKind if any(iv.action.kind == k for row in timeline.intervals.values() for iv in row)]
    lines = ["legend: " + "  ".join(f"{k.value} {KIND_NAMES[k]}" for k in kinds) + "  .. idle"]
    digits = "0-9, then a-z, A-Z" if m <= len(_MICROBATCH_CHARS) else "its number"
    lines.append(f"        the character(s) after the letter: the microbatch ({digits})")
    if timeline.num_stages > timeline.ranks:
        lines.append("        lower-case letter: the rank's second (fourth, ...) stage in its list")
    return lines


# ---------------------------------------------------------------------------------------- PNG

_COLOURS = {
    ActionKind.FORWARD: "#4C72B0",
    ActionKind.BACKWARD: "#C44E52",
    ActionKind.BACKWARD_INPUT: "#DD8452",
    ActionKind.BACKWARD_WEIGHT: "#55A868",
}
_IDLE = "#D9D9D9"


def render_png(
    timeline: Timeline,
    path: str | os.PathLike,
    title: str = "pipeline schedule",
    schedule: PipelineSchedule | str | None = None,
) -> str:
    """Rank x time grid coloured by action kind, microbatch in each box, bubble figures in the title."""
    figure_cls = _matplotlib_figure()
    p, _, _ = _sizes(timeline)
    width = min(max(8.0, 0.28 * timeline.makespan / _time_unit(timeline) + 2.5), 40.0)
    fig = figure_cls(figsize=(width, 1.6 + 0.55 * p), layout="constrained")
    ax = fig.subplots()
    ax.set_facecolor(_IDLE)  # whatever no box covers is idle time
    for rank in range(p):
        chunk_of = {stage: i for i, stage in enumerate(timeline.stages_on(rank))}
        for iv in timeline.intervals[rank]:
            _draw_box(ax, iv, rank, chunk_of[iv.action.stage])
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"rank {r}\nstage {','.join(map(str, timeline.stages_on(r)))}" for r in range(p)])
    ax.set_xlabel(f"time (costs {_costs_text(timeline.costs)})")
    ax.set_title(title + "\n" + "   |   ".join(bubble_lines(timeline, schedule)), fontsize=9)
    ax.legend(handles=_legend_handles(timeline), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120)
    return os.fspath(path)


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot state
    except ImportError as err:
        raise ImportError(f"drawing a PNG needs matplotlib, which is not installed; run: {PLOT_EXTRA}") from err
    return Figure


def _shade(colour: str, chunk: int) -> str:
    """The rank's later stage chunks in a lighter shade of the kind's colour."""
    from matplotlib.colors import to_hex, to_rgb

    mix = 0.45 * (chunk % 2)
    return to_hex(tuple(c + (1 - c) * mix for c in to_rgb(colour)))


def _draw_box(ax: Any, interval: Interval, rank: int, chunk: int) -> None:
    from matplotlib.patches import Rectangle

    action = interval.action
    colour = _shade(_COLOURS[action.kind], chunk)
    ax.add_patch(
        Rectangle(
            (interval.start, rank - 0.4),
            interval.end - interval.start,
            0.8,
            facecolor=colour,
            edgecolor="white",
            linewidth=0.6,
        )
    )
    ax.text(
        (interval.start + interval.end) / 2,
        rank,
        str(action.microbatch),
        ha="center",
        va="center",
        fontsize=7,
        color="white" if chunk % 2 == 0 else "black",
    )


def _legend_handles(timeline: Timeline) -> list:
    from matplotlib.patches import Patch

    kinds = {iv.action.kind for row in timeline.intervals.values() for iv in row}
    handles = [Patch(facecolor=_COLOURS[k], label=f"{k.value}: {KIND_NAMES[k]}") for k in ActionKind if k in kinds]
    if timeline.num_stages > timeline.ranks:
        handles.append(Patch(facecolor=_shade(_COLOURS[ActionKind.FORWARD], 1), label="lighter: rank's 2nd chunk"))
    handles.append(Patch(facecolor=_IDLE, label="idle"))
    return handles


# ---------------------------------------------------------------------------------------- l5d schedule


def register(subparsers: Any) -> None:
    """Add ``l5d schedule`` to an argparse subparsers object."""
    cmd = subparsers.add_parser(
        "schedule",
        help="draw a pipeline schedule from torch's action lists, with its simulated bubble",
        description="Draw the per-rank compute actions torch's pipeline schedule runs, timed by a simple "
        "simulation, and compare its bubble with the planner's formula. See docs/pipeline_schedules.md.",
    )
    cmd.add_argument("--schedule", choices=[s.value for s in PipelineSchedule], default="1f1b")
    cmd.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    cmd.add_argument("--microbatches", type=int, default=None, help="m per pipeline run (default 2*pp)")
    cmd.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        help="v stages per rank (default 2 for interleaved_1f1b, zbv, dualpipev; else 1)",
    )
    cmd.add_argument("--png", metavar="FILE.png", help=f"also write a PNG (needs matplotlib: {PLOT_EXTRA})")
    costs = cmd.add_argument_group("simulated cost of one action on one stage")
    costs.add_argument("--forward-cost", type=_positive, default=1.0)
    costs.add_argument("--backward-input-cost", type=_positive, default=1.0)
    costs.add_argument("--backward-weight-cost", type=_positive, default=1.0)
    cmd.set_defaults(func=run_schedule)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def run_schedule(args: argparse.Namespace) -> int:
    schedule = PipelineSchedule(args.schedule)
    v = args.virtual_stages
    if v is None:
        v = 2 if schedule in V_SHAPED or schedule == PipelineSchedule.INTERLEAVED_1F1B else 1
    m = args.microbatches if args.microbatches is not None else default_microbatches(args.pp, v)
    costs = ActionCosts(args.forward_cost, args.backward_input_cost, args.backward_weight_cost)
    try:
        if args.pp < 1:
            raise LayoutError(f"--pp={args.pp} must be >= 1.")
        timeline = simulate(action_lists(schedule, args.pp, m, v), costs)
    except (LayoutError, ScheduleDeadlockError) as err:
        print(f"l5d schedule: {err}", file=sys.stderr)
        return 2
    print(render_text(timeline, schedule))
    if args.png:
        title = f"{schedule.value}: pp={args.pp}, microbatches={m}" + (f", virtual_stages={v}" if v > 1 else "")
        try:
            written = render_png(timeline, args.png, title, schedule)
        except ImportError as err:
            print(f"l5d schedule: {err}", file=sys.stderr)
            return 1
        print(f"wrote {written}")
    return 0
