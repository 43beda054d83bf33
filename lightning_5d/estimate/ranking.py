"""The order `l5d plan` ranks layouts in, and the words for why one row beats the next.

Criteria, compared in this order (the first that differs decides):

1. step time - predicted seconds per step, scaled to one global batch where layouts differ in it
   (i.e. time per token);
2. exposed communication - seconds of traffic compute does not hide: the part of the step most
   sensitive to a link slower or busier than assumed;
3. memory headroom - usable GiB left free: room for fragmentation, longer sequences, a bigger
   micro-batch;
4. bubble - the pipeline's idle share of the step;
5. communication time - all traffic, hidden included (it still takes SMs and links);
6. simplicity - fewer model-parallel dimensions, lower ZeRO stage, less recomputation, fewer
   model-parallel ranks;
7. the layout's text, so the order is total and reproducible.

Values are compared at a stated precision (step time and memory used: 4 and 3 significant digits;
communication: 1 us; bubble: 0.1 %), so a row never wins on a rounding error nobody can see.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lightning_5d.config import ActivationCheckpointing

from .estimator import Estimate
from .timing import GIB, StepTime

# Cheapest in time first (plan() also tries them in this order and keeps the first that fits).
RECOMPUTE_ORDER = (ActivationCheckpointing.NONE, ActivationCheckpointing.SELECTIVE, ActivationCheckpointing.FULL)
_MODEL_DIMS = ("tp", "cp", "pp", "ep")


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


@dataclass(frozen=True)
class Candidate:
    """One layout as the ranking sees it: its estimate, its step time, and the memory it may use."""

    estimate: Estimate
    time: StepTime
    usable_bytes: float
    batch_tokens: int | None = None  # compare step times at this global batch (None: the layout's own)

    @property
    def step_time(self) -> float:
        """Seconds per step, scaled to ``batch_tokens`` when layouts run different global batches."""
        own = self.estimate.flops.tokens_per_step
        return self.time.total * (self.batch_tokens or own) / own

    @property
    def headroom_gib(self) -> float:
        return (self.usable_bytes - self.estimate.memory.total) / GIB


@dataclass(frozen=True)
class Criterion:
    name: str
    key: Callable[[Candidate], object]  # smaller ranks first; already rounded
    show: Callable[[Candidate], str]


def _model_dims(c: Candidate) -> int:
    return sum(getattr(c.estimate.setup, d) > 1 for d in _MODEL_DIMS)


def _model_ranks(c: Candidate) -> int:
    s = c.estimate.setup
    return s.tp * s.cp * s.pp * s.ep


def _bubble_pct(c: Candidate) -> float:
    return 100 * c.time.bubble / c.time.total


def _step_show(c: Candidate) -> str:
    own = c.estimate.flops.tokens_per_step
    scaled = f" (for {c.batch_tokens:,} tokens)" if c.batch_tokens and c.batch_tokens != own else ""
    return f"{c.step_time:#.4g} s{scaled}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3f} ms" if seconds < 0.01 else f"{1e3 * seconds:.1f} ms"


def _headroom_show(c: Candidate) -> str:
    used = c.estimate.memory.total
    used_text = f"{used / GIB:.1f} GiB" if used >= 0.1 * GIB else f"{used / 2**20:.3g} MiB"
    return f"{c.headroom_gib:.1f} GiB free ({used_text} used)"


CRITERIA: tuple[Criterion, ...] = (
    Criterion("step time", lambda c: _sig(c.step_time), _step_show),
    Criterion(
        "exposed communication",
        lambda c: round(sum(c.time.exposed.values()), 6),
        lambda c: _ms(sum(c.time.exposed.values())),
    ),
    # More headroom is less memory used (the usable memory is the cluster's, the same for every row).
    Criterion("memory headroom", lambda c: _sig(c.estimate.memory.total, 3), _headroom_show),
    Criterion("bubble", lambda c: round(_bubble_pct(c), 1), lambda c: f"{_bubble_pct(c):.1f}% of the step"),
    Criterion(
        "communication time (hidden included)",
        lambda c: round(sum(c.time.comm.values()), 6),
        lambda c: _ms(sum(c.time.comm.values())),
    ),
    Criterion("model-parallel dimensions", _model_dims, lambda c: str(_model_dims(c))),
    Criterion("ZeRO stage", lambda c: int(c.estimate.setup.zero), lambda c: str(int(c.estimate.setup.zero))),
    Criterion(
        "recomputation",
        lambda c: RECOMPUTE_ORDER.index(c.estimate.setup.recompute),
        lambda c: c.estimate.setup.recompute.value,
    ),
    Criterion("model-parallel ranks", _model_ranks, lambda c: str(_model_ranks(c))),
    Criterion("layout", lambda c: c.estimate.setup.describe(), lambda c: c.estimate.setup.describe()),
)
LAST_RESORT = CRITERIA[-1]  # an order, not a reason: the two rows predict the same in every respect


def rank_key(c: Candidate) -> tuple:
    return tuple(criterion.key(c) for criterion in CRITERIA)


def deciding_criterion(a: Candidate, b: Candidate) -> Criterion | None:
    """The first criterion on which ``a`` and ``b`` differ (None: identical in every one)."""
    for criterion in CRITERIA:
        if criterion.key(a) != criterion.key(b):
            return criterion
    return None


def why_ahead(a: Candidate, b: Candidate) -> str:
    """One line: why ``a`` ranks above ``b`` - the deciding criterion with both values, and what tied before it."""
    decider = deciding_criterion(a, b)
    if decider is None:
        return "identical in every criterion"
    if decider is LAST_RESORT:
        return "no prediction differs; ordered by layout text"
    tied = CRITERIA[: CRITERIA.index(decider)]
    line = f"{decider.name}: {decider.show(a)} vs {decider.show(b)}"
    if tied:
        rest = [c.name for c in tied[1:]]
        line += f"; equal step time ({tied[0].show(a)})" + "".join(f", {name}" for name in rest)
    return line
