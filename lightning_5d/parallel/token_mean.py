"""A step's cross-entropy as one process computes it on the whole batch: a mean over its tokens.

One process computes ``F.cross_entropy(..., reduction="mean")`` on the global batch as
Σ(token losses) / N, where N counts the targets of the *whole* batch (labels other than
``ignore_index``, or their class weights). The layouts cut that batch three ways, and each
part then took the mean of its own targets:

* data ranks (dp): the gradient reduction averages the ranks' gradients;
* cp ranks: each holds a shard of every sequence;
* pipeline microbatches: pp averages their losses (the schedule's 1/m).

An average of means is the mean only when every part counts the same N_i. With padding, or
with an SFT prompt masked with -100, it does not: before, dp2 trained 2.2e-2 and pp2 (2
microbatches) 1.2e-2 away from one process in 3 steps (parameter vector error; cp2 was
already exact, and this is its rule made general). Inside a step, each such call becomes a
mean over the *group* of ranks that hold parts of the batch: dp × cp in training (the group
the gradient reduction averages over; also for a value computed without gradients, such as
the FP8 numerics check's reference loss, which must equal the step's), cp alone in
validation and test (Lightning's ``sync_dist`` combines data ranks' logged values):

* its value is Σ_group(local sum) / Σ_group(N_i), one all-reduce of the pair, the same on
  every rank of the group; its backward is multiplied by |group|, because the gradient
  reduction averages over that group while the loss is a sum over it;
* under pp, microbatch j's backward is further scaled by w_j = m · N_j / Σ_k N_k, so that pp's
  mean over the microbatches, Σ_j w_j · mean_j / m, is the batch's token mean. The value the
  step sees stays microbatch j's mean; the pipeline weights logged means and the returned loss
  by N_j when it combines the microbatches. Microbatch j's backward may run before microbatch
  j + 1's forward (1F1B), so the N_k are read ahead from the batch: the first call of each call
  site finds which integer tensor of the microbatch its targets are (equal to it, or to it
  shifted by one as Hugging Face's causal LMs shift ``labels``), compared element by element
  (:class:`MicrobatchWeights`), and every later call's count is checked against the counts
  read. A loss whose counts the batch does not predict is refused before its gradients reach
  an optimizer step.

``reduction="sum"`` and ``"none"`` and the legacy flags are left alone: the common
``F.cross_entropy(..., reduction="sum") / own_count`` (Hugging Face's loss with
``num_items_in_batch``) divides by the part's own count afterwards, and a group sum there
would count every part again. Such a loss, like any loss the step reduces itself, is averaged
over the parts as before (docs/model_support.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
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
LABEL_KEYS = ("labels", "label", "targets", "target")  # a batch's labels by the names data loaders use (cp too)
_COUNT_RTOL = 1e-9  # class-weight sums may add in another order than the labels' count
Group = tuple[Any, int]  # (process group, size)


class TokenMeanError(LayoutError):
    """A step's loss whose token counts the layout cannot weight exactly; the message says what to change."""


@dataclass(frozen=True)
class LossGroups:
    """The ranks that hold parts of one batch: over these a step's mean is taken."""

    train: Group  # dp x cp: the group the gradient reduction averages over
    eval: Group  # cp: data ranks' logged values are Lightning's sync_dist's to combine


class _SumOverGroup(torch.autograd.Function):
    """Forward: (the group's sum of ``x``, of ``count``) in at least fp32, one all-reduce. Backward:
    ``x``'s incoming gradient times the group's size (the gradient reduction averages over the group)."""

    @staticmethod
    def forward(ctx, x: Tensor, count: Tensor, group: Any, size: int):  # type: ignore[override]
        both = torch.stack([x.detach().to(torch.float64).reshape(()), count.to(torch.float64).reshape(())])
        dist.all_reduce(both, group=group)
        ctx.size, ctx.dtype = size, x.dtype
        total = both[1].clone()
        ctx.mark_non_differentiable(total)
        return both[0].to(torch.promote_types(x.dtype, torch.float32)), total

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_count: Tensor):  # type: ignore[override]
        return (grad * ctx.size).to(ctx.dtype), None, None, None


class _ScaleBackward(torch.autograd.Function):
    """Forward: ``x`` as it is. Backward: the incoming gradient times ``scale`` (pp's w_j)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.scale.to(grad.dtype), None


def bind_cross_entropy(args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name where it takes a mean; None where its own result is kept
    (``"sum"``, ``"none"``, the legacy flags: the step divides or reduces them itself)."""
    bound = {**dict(zip(CROSS_ENTROPY_ARGS, args)), **kwargs}
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        return None
    return bound if bound.get("reduction", "mean") == "mean" else None


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


class Relation(Enum):
    """How a call's targets are one of the batch's integer tensors."""

    EQUAL = "{}"  # aligned labels: labels[t] is the token after input_ids[t]
    SHIFTED = "{}[..., 1:]"  # labels equal to the inputs, shifted by the step (logits[:, :-1])
    SHIFTED_PADDED = "{}[..., 1:] padded with ignore_index"  # Hugging Face: pad(labels, (0, 1))[..., 1:]

    def of(self, t: Tensor, ignore_index: int) -> Tensor:
        if self is Relation.EQUAL:
            return t
        if self is Relation.SHIFTED:
            return t[..., 1:]
        return F.pad(t, (0, 1), value=ignore_index)[..., 1:]


def integer_tensors(batch: Any) -> list[tuple[str, Tensor]]:
    """(name, tensor) of every integer tensor of a microbatch: a mapping's ``labels`` (``label``,
    ``targets``, ``target``) first, then its other entries; a tuple's in order."""
    if isinstance(batch, Mapping):
        keys = [k for k in LABEL_KEYS if k in batch] + [k for k in batch if k not in LABEL_KEYS]
        found = [(f"batch[{k!r}]", batch[k]) for k in keys]
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        found = [(f"batch[{i}]", t) for i, t in enumerate(batch)]
    else:
        found = [("batch", batch)]
    return [(n, t) for n, t in found if isinstance(t, Tensor) and t.dim() > 0 and not t.is_floating_point()]


def find_targets(batch: Any, target: Tensor, ignore_index: int, shifts: bool) -> list[tuple[int, Relation]]:
    """Every (position, relation) by which ``target`` is one of ``batch``'s integer tensors, element by element."""
    relations = list(Relation) if shifts else [Relation.EQUAL]
    found = []
    for position, (_, t) in enumerate(integer_tensors(batch)):
        for relation in relations:
            candidate = relation.of(t, ignore_index)
            if candidate.numel() == target.numel() and torch.equal(
                candidate.reshape(-1).to(target.device, target.dtype), target.reshape(-1)
            ):
                found.append((position, relation))
    return found


@dataclass
class _Site:
    """One cross-entropy call site of the step (its n-th mean call in a microbatch) over one pipeline run."""

    counts: Tensor | None  # [m] the group's counts read from the batch, or None: every call must count the same
    first: float = math.nan  # with counts None: what the first call counted
    reads: str = ""  # what the counts were read from, for the refusal


@dataclass
class MicrobatchWeights:
    """Pipeline microbatch weights w_j = m · N_j / Σ N_k of one run (module docstring).

    ``where()``: (the microbatch the step runs, the run's microbatches); index -1 outside a
    microbatch (the pipeline's shape probe). ``shifts``: whether targets may be a tensor of the
    batch shifted by one (not under cp, whose shards cut the sequence). ``record(counts)``: gives
    the pipeline the first call site's counts, by which it weights the microbatches' logged
    means and returned losses.
    """

    where: Callable[[], tuple[int, list]]
    shifts: bool
    record: Callable[[list[float] | None], None] = lambda counts: None
    _sites: dict[int, _Site] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)

    def weight(self, bound: dict, counted: Tensor, group: Group, backpropagated: bool) -> Tensor | None:
        """w_j for this call's mean (``counted``: the group's count), or None for 1. A count the batch did
        not predict is refused where the call is backpropagated, and unweights the logs where it is not."""
        index, microbatches = self.where()
        if index < 0:
            return None
        call = self._calls.get(index, 0)
        self._calls[index] = call + 1
        seen = float(counted)
        site = self._sites.get(call)
        if site is None:
            site = self._sites[call] = self._predict(bound, microbatches, index, seen, group)
            if call == 0:
                self.record(None if site.counts is None else [float(c) for c in site.counts])
        expected = site.first if site.counts is None else float(site.counts[index])
        if not math.isclose(seen, expected, rel_tol=_COUNT_RTOL):
            if backpropagated:
                raise TokenMeanError(self._refusal(site, call, index, seen, expected, len(microbatches)))
            warnings.warn(
                f"{self._refusal(site, call, index, seen, expected, len(microbatches)).split('. pp weights')[0]}: "
                f"the microbatches' logged means are combined unweighted for this batch, which is not one process's "
                f"mean over it where they count different targets."
            )
            self.record(None)
            return None
        if site.counts is None:  # every call counts the same: pp's mean of means is the batch's mean
            return None
        return site.counts[index] * len(microbatches) / site.counts.sum()

    def _predict(self, bound: dict, microbatches: list, index: int, seen: float, group: Group) -> _Site:
        """Every microbatch's count for this call site, read from the tensor of the batch its targets are.

        Targets may equal several tensors here (``input_ids[..., 1:]`` and ``labels[..., 1:]`` where this
        microbatch masks nothing): where they count differently elsewhere, those holding ``ignore_index``
        somewhere in the run (labels) are preferred over those without (inputs), then the first."""
        target, ignore_index = bound["target"], bound.get("ignore_index", -100)
        matches = [] if target.is_floating_point() else find_targets(microbatches[index], target, ignore_index,
                                                                      self.shifts)  # fmt: skip
        candidates = []  # (counts in every microbatch, what they were read from, whether it holds ignore_index)
        for position, relation in matches:
            tensors = [integer_tensors(mb)[position][1] for mb in microbatches]
            counts = tuple(
                float(counted_targets({**bound, "target": relation.of(t, ignore_index).reshape(-1).to(target.device)}))
                for t in tensors
            )
            name = relation.value.format(integer_tensors(microbatches[index])[position][0])
            candidates.append((counts, name, any(bool((t == ignore_index).any()) for t in tensors)))
        if len({c[0] for c in candidates}) > 1:
            candidates = [c for c in candidates if c[2]] or candidates
        # Still several (targets all ignored here): the first, labels before other entries, unshifted first;
        # every later call checks it.
        chosen = candidates[0] if candidates else None
        local = [0.0] * len(microbatches) if chosen is None else list(chosen[0])
        # Each rank's counts are its own tensors'; their sum is what the group's calls count (checked per call).
        table = torch.tensor([*local, float(chosen is not None)], dtype=torch.float64, device=target.device)
        group_, size = group
        if size > 1:
            dist.all_reduce(table, group=group_)
        if int(table[-1]) != size:  # some rank read nothing: every microbatch must count the same
            return _Site(counts=None, first=seen)
        return _Site(counts=table[:-1], reads=chosen[1] if chosen is not None else "")

    @staticmethod
    def _refusal(site: _Site, call: int, index: int, seen: float, expected: float, m: int) -> str:
        if site.counts is not None:
            found = f"where {site.reads} of the microbatch holds {expected:g}"
        else:
            found = (
                f"and an earlier microbatch {expected:g}, while its targets are no tensor of the batch (equal to one, "
                f"or to one shifted by a position), from which the counts could be read before the run"
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
    """While a step runs: its ``F.cross_entropy`` means taken over the batch (module docstring).

    ``backward``: the group of every call in training (dp x cp, where gradients are averaged; None
    in evaluation), ``values``: the group in evaluation (cp). ``mark`` records a value that is
    already the same on every cp rank."""

    def __init__(
        self, backward: Group | None, values: Group, mark: Callable[[Tensor], Tensor] | None = None,
        microbatches: MicrobatchWeights | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.backward, self.values = backward, values
        self.mark = mark
        self.microbatches = microbatches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.cross_entropy:
            return func(*args, **kwargs)
        bound = bind_cross_entropy(args, kwargs)
        if bound is None:
            return func(*args, **kwargs)
        backpropagated = self.backward is not None and torch.is_grad_enabled() and bound["input"].requires_grad
        group = self.values if self.backward is None else self.backward
        local_sum = func(**{**bound, "reduction": "sum"})
        count = counted_targets(bound)
        wide = torch.promote_types(local_sum.dtype, torch.float32)  # a bf16 count above 256 is already rounded
        total = local_sum.to(wide)
        if group[1] > 1:
            total, count = _SumOverGroup.apply(local_sum, count, *group)
        weight = None
        if self.microbatches is not None:
            weight = self.microbatches.weight(bound, count, group, backpropagated)
        if weight is not None and not float(count):  # no targets in this microbatch: it adds nothing
            value = total * 0.0
        else:
            value = total / count.to(wide)
        if weight is not None and backpropagated:
            value = _ScaleBackward.apply(value, weight)
        value = value.to(local_sum.dtype)
        return self.mark(value) if self.mark is not None else value
