"""A step's cross-entropy as one process computes it on the whole batch: a mean over its tokens.

One process computes ``F.cross_entropy(..., reduction="mean")`` on the global batch as
Σ(token losses) / N, where N counts the targets of the *whole* batch (labels other than
``ignore_index``, or their class weights). The layouts cut that batch three ways, and each
part then took the mean of its own tokens:

* data ranks (dp): the gradient reduction averages the ranks' gradients;
* cp ranks: each holds a shard of every sequence;
* pipeline microbatches: pp averages their losses (the schedule's 1/m).

An average of means is the mean only when every part counts the same N_i. With padding, or
with an SFT prompt masked with -100, it does not: before, dp2 trained 2.2e-2 and pp2 (2
microbatches) 1.2e-2 away from one process in 3 steps (parameter vector error; cp2 was
already exact, this is its rule made general). Inside a step, the user's cross-entropy
therefore becomes, over the *group* of ranks that hold parts of the batch (dp × cp in
training, cp alone in evaluation, where Lightning's ``sync_dist`` combines data ranks):

* ``"mean"``: Σ_group(local sum) / Σ_group(N_i): one all-reduce of the pair, the same value on
  every rank of the group. Its backward is multiplied by |group|, because the gradient
  reduction averages over that group while the loss is a sum over it.
* ``"sum"``: the group's sum, with the same backward.
* Under pp, microbatch j's value is then scaled by w_j = m · N_j / Σ_k N_k (``"sum"``: by m),
  so that pp's mean over the microbatches, Σ_j w_j · mean_j / m, is the batch's token mean.
  Microbatch j's backward may run before microbatch j + 1's forward (1F1B), so the counts
  N_k are read ahead from the batch's labels (``label_counts``) and checked against what each
  call then counts (:class:`MicrobatchWeights`); a step whose counts the labels do not
  predict is refused before any optimizer step.

Per-token (``reduction="none"``) and legacy-flag calls are left alone: the step reduces them
itself, and the layout averages the parts' results as before (docs/model_support.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_5d.config import LayoutError

CROSS_ENTROPY_ARGS = (
    "input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing",
)  # fmt: skip
LABEL_KEYS = ("labels", "label", "targets", "target")  # a batch's labels, by the names data loaders use
_COUNT_RTOL = 1e-9  # class-weight sums may add in another order than the labels' count


class TokenMeanError(LayoutError):
    """A step's loss whose token counts the layout cannot weight exactly; the message says what to change."""


class _SumOverGroup(torch.autograd.Function):
    """Forward: (the group's sum of ``x``, of ``count``), one all-reduce. Backward: ``x``'s incoming
    gradient times the group's size (the gradient reduction averages over the same group)."""

    @staticmethod
    def forward(ctx, x: Tensor, count: Tensor, group: Any, size: int):  # type: ignore[override]
        both = torch.stack([x.detach().to(torch.float64).reshape(()), count.to(torch.float64).reshape(())])
        dist.all_reduce(both, group=group)
        ctx.size = size
        total = both[1].clone()
        ctx.mark_non_differentiable(total)
        return both[0].to(x.dtype), total

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_count: Tensor):  # type: ignore[override]
        return grad * ctx.size, None, None, None


def bind_cross_entropy(args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name, or None where the call's own result is kept (per-token output, legacy flags)."""
    bound = {**dict(zip(CROSS_ENTROPY_ARGS, args)), **kwargs}
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        return None
    return None if bound.get("reduction", "mean") == "none" else bound


def counted_targets(bound: dict) -> Tensor:
    """What ``reduction="mean"`` divides by: non-ignored (class-weighted) targets, or rows for probability targets."""
    logits, target = bound["input"], bound["target"]
    if target.is_floating_point():
        rows = logits.numel() // logits.size(1) if logits.dim() >= 2 else 1
        return torch.tensor(float(rows), dtype=torch.float64, device=target.device)
    valid = target != bound.get("ignore_index", -100)
    weight = bound.get("weight")
    if weight is None:
        return valid.sum().to(torch.float64)
    return weight[target[valid]].sum().to(torch.float64)


def find_labels(batch: Any) -> Tensor | None:
    """The batch's integer labels: a mapping's ``labels`` (or ``label``, ``targets``, ``target``), or a
    tuple's last integer tensor after its first; None where there is none to read."""
    if isinstance(batch, Mapping):
        found = next((batch[k] for k in LABEL_KEYS if isinstance(batch.get(k), Tensor)), None)
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        tensors = [t for t in batch if isinstance(t, Tensor)]
        found = next((t for t in reversed(tensors[1:]) if not t.is_floating_point()), None)
    else:
        found = None
    return found if found is not None and not found.is_floating_point() else None


def label_counts(bound: dict, labels: Tensor, shifted: bool) -> Tensor:
    """What a call like ``bound`` would count on ``labels`` (``shifted``: on ``labels[..., 1:]``, where a
    model shifts labels equal to its inputs, as Hugging Face's causal LMs do)."""
    if shifted:
        labels = labels[..., 1:]
    return counted_targets({**bound, "target": labels.reshape(-1)})


@dataclass(frozen=True)
class LossGroups:
    """The ranks that hold parts of one batch, as (process group, size): over these a step's mean is taken."""

    train: tuple[Any, int]  # dp x cp: the group the gradient reduction averages over
    eval: tuple[Any, int]  # cp: data ranks' logged values are Lightning's sync_dist's to combine


@dataclass
class _Site:
    """One cross-entropy call site of the step (its n-th call in a microbatch) over one pipeline run."""

    counts: Tensor | None  # [m] predicted counts the calls matched, or None: every call must count the same
    first: float = math.nan  # with counts None: what the first call counted
    reads: str = ""  # the labels the counts were read from, for the refusal


@dataclass
class MicrobatchWeights:
    """Pipeline microbatch weights w_j = m · N_j / Σ N_k of one run (module docstring).

    ``where()``: (the microbatch the step runs, the run's microbatches); index -1 outside a
    microbatch (the pipeline's shape probe). ``shifted``: whether counts of ``labels[..., 1:]``
    may be what a call counts (not under cp, whose shards cut the sequence).
    """

    where: Callable[[], tuple[int, list]]
    shifted: bool
    _sites: dict[int, _Site] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)

    def sum_scale(self, bound: dict, counted: Tensor, group: Any, size: int) -> tuple[float | Tensor | None, bool]:
        """(the factor for this call's group sum, whether it replaces the mean), or (None, False) to keep the
        call's mean. A mean becomes Σ_group / Σ_k N_k · m; a sum is scaled by m (``counted``: the group's count)."""
        index, microbatches = self.where()
        if index < 0:
            return None, False
        m = len(microbatches)
        if bound.get("reduction", "mean") == "sum":
            return float(m), True
        call = self._calls.get(index, 0)
        self._calls[index] = call + 1
        seen = float(counted)
        site = self._sites.get(call)
        if site is None:
            site = self._sites[call] = self._predict(bound, microbatches, index, seen, group, size)
        expected = site.first if site.counts is None else float(site.counts[index])
        if not math.isclose(seen, expected, rel_tol=_COUNT_RTOL):
            raise TokenMeanError(self._refusal(site, call, index, seen, expected, m))
        if site.counts is None:  # every call counts the same: pp's mean of means is the batch's mean
            return None, False
        # Σ_group sum / Σ_k N_k · m rather than mean_j · w_j: no 0/0 where a microbatch counts nothing.
        return m / site.counts.sum(), True

    def _predict(self, bound: dict, microbatches: list, index: int, seen: float, group: Any, size: int) -> _Site:
        """The counts every microbatch's call will make, read from the run's labels and chosen by this call's."""
        labels = [find_labels(mb) for mb in microbatches]
        if any(t is None for t in labels):
            return _Site(counts=None, first=seen)
        rows = [[label_counts(bound, t, shifted=False) for t in labels]]
        if self.shifted and all(t.dim() >= 2 for t in labels):
            rows.append([label_counts(bound, t, shifted=True) for t in labels])
        table = torch.stack([torch.stack(r) for r in rows])
        if size > 1:
            dist.all_reduce(table, group=group)  # every rank of the group reads its part of each microbatch
        for row, reads in zip(table, ("the labels", "the labels[..., 1:]")):
            if math.isclose(float(row[index]), seen, rel_tol=_COUNT_RTOL):
                return _Site(counts=row, reads=reads)
        return _Site(counts=None, first=seen)

    @staticmethod
    def _refusal(site: _Site, call: int, index: int, seen: float, expected: float, m: int) -> str:
        if site.counts is not None:
            found = f"where {site.reads} of the batch hold {expected:g} there"
        else:
            found = (
                f"and an earlier microbatch {expected:g}, while no labels of the batch (a 'labels' entry, or the last "
                f"integer tensor of a tuple) predicted those counts"
            )
        return (
            f"F.cross_entropy call {call + 1} of the step counted {seen:g} targets in pipeline microbatch {index} "
            f"of {m}, {found}. pp weights each microbatch's mean by its share of the batch's targets, so that their "
            f"average is the mean over the whole batch that one process computes; microbatch 0's backward may run "
            f"before the last one's forward, so the counts must be known from the batch before the run. Put the "
            f"ignored positions (-100) into the batch's 'labels' (aligned with input_ids, or equal to them for a "
            f"model that shifts them itself) instead of masking targets inside the step, or use pp=1."
        )


class TokenMean(TorchFunctionMode):
    """While a step runs: its ``F.cross_entropy`` as the mean over the group's part of the batch
    (module docstring). ``mark``: records a value that is already the same on every cp rank."""

    def __init__(
        self, group: Any, size: int, mark: Callable[[Tensor], Tensor] | None = None,
        microbatches: MicrobatchWeights | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.group, self.size = group, size
        self.mark = mark
        self.microbatches = microbatches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.cross_entropy:
            return func(*args, **kwargs)
        bound = bind_cross_entropy(args, kwargs)
        if bound is None:
            return func(*args, **kwargs)
        local_sum = func(**{**bound, "reduction": "sum"})
        count = counted_targets(bound)
        if self.size > 1:
            total, count = _SumOverGroup.apply(local_sum, count, self.group, self.size)
        else:
            total = local_sum
        wide = torch.promote_types(total.dtype, torch.float32)  # a bf16 count above 256 is already rounded
        scale, replaces = None, False
        if self.microbatches is not None:
            scale, replaces = self.microbatches.sum_scale(bound, count, self.group, self.size)
        if replaces:
            value = (total.to(wide) * scale).to(total.dtype)
        elif bound.get("reduction", "mean") == "sum":
            value = total
        else:
            value = (total.to(wide) / count.to(wide)).to(total.dtype)
        return self.mark(value) if self.mark is not None else value
