"""What a pipeline schedule costs: idle time (the bubble) and activations kept in flight.

Symbols: p stages, m microbatches per pipeline run, v model chunks per rank.
Two bubble conventions, both reported:

* relative to ideal: bubble time / ideal compute time. AFAB and 1F1B ``(p-1)/m``,
  interleaved 1F1B ``(p-1)/(v*m)`` (Narayanan et al. 2021; the playbook).
* fraction of total: bubble time / (ideal + bubble) = r / (1 + r), e.g. ``(p-1)/(m+p-1)``.

Zero-bubble family, with per-microbatch stage times F (forward), B (input-gradient backward),
W (weight-gradient backward) and the usual assumption F = B = W (so 1F1B's F+B+W = 3F):
ZB-H1 idles ``(p-1)(F+B-W)`` -> ``(p-1)/(3m)``; ZB-V runs half-size chunks, whose warm-up
and cool-down cost half as much -> ``(p-1)/(6m)``; DualPipeV idles ``(p/2-1)(F&B+B-3W)``
in chunk units, F&B = F+B without overlap credit -> ``(p-2)/(6m)``. These three are modelled
estimates, not published closed forms; clamp at 0.
"""

from __future__ import annotations

from lightning_5d.config import PipelineSchedule

from .training import TrainingSetup


def bubble_relative(
    p: int, m: int, v: int = 1, schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
) -> float:
    """Pipeline idle time divided by the ideal (bubble-free) compute time."""
    schedule = PipelineSchedule(schedule)
    if p <= 1:
        return 0.0
    if schedule in (PipelineSchedule.AFAB, PipelineSchedule.ONE_F_ONE_B):
        return (p - 1) / m
    if schedule == PipelineSchedule.INTERLEAVED_1F1B:
        return (p - 1) / (v * m)
    if schedule == PipelineSchedule.ZERO_BUBBLE:
        return (p - 1) / (3 * m)
    if schedule == PipelineSchedule.ZBV:
        return (p - 1) / (6 * m)
    if schedule == PipelineSchedule.DUALPIPEV:
        return max(p - 2, 0) / (6 * m)
    raise ValueError(f"no bubble model for schedule {schedule!r}")


def bubble_fraction(
    p: int, m: int, v: int = 1, schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
) -> float:
    """Pipeline idle time as a fraction of the whole step: r / (1 + r), e.g. (p-1)/(m+p-1)."""
    r = bubble_relative(p, m, v, schedule)
    return r / (1 + r)


def in_flight_layer_microbatches(setup: TrainingSetup, num_layers: int) -> float:
    """Layer-microbatches of activations the first stage holds at its peak.

    Without pp: one microbatch through all L layers (gradient accumulation runs them one by
    one). AFAB keeps all m microbatches of its L/p layers; 1F1B and ZB-H1 keep min(p, m)
    (Narayanan et al.); interleaved 1F1B keeps L(1 + (p-1)/(p*v)) (Korthikanti et al. 2022,
    sec. 4.2.3); ZB-V matches 1F1B; DualPipeV keeps p+1 microbatches (DeepSeek's table).
    Never more than all m microbatches.
    """
    p, m, v, L = setup.pp, setup.m, setup.v, num_layers
    if p == 1:
        return float(L)
    per_stage = L / p
    cap = m * per_stage
    schedule = setup.schedule
    if schedule == PipelineSchedule.AFAB:
        held = cap
    elif schedule == PipelineSchedule.INTERLEAVED_1F1B:
        held = L * (1 + (p - 1) / (p * v))
    elif schedule == PipelineSchedule.DUALPIPEV:
        held = (p + 1) * per_stage
    else:  # 1F1B, ZB-H1, ZB-V
        held = p * per_stage
    return min(held, cap)


def last_stage_in_flight(setup: TrainingSetup) -> int:
    """Microbatches whose activations the last stage holds: it turns each around at once, except AFAB."""
    if setup.pp == 1 or setup.schedule != PipelineSchedule.AFAB:
        return 1
    return setup.m
