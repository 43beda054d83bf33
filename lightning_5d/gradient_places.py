"""Where each parameter's gradient one process would hold is on this rank, between backward and step.

One answer for the two readers of gradients in the user's hooks: the watch on those hooks
(``gradient_reads``: what a ``.grad`` read stands for) and ``lightning_5d.grad_norm`` (which
piece of each gradient this rank adds to the norm).

* A tp-sharded parameter's ``.grad`` is its shard; a routed expert's, this ep rank's experts.
* ZeRO-1/2 reduce each gradient into the optimizer's slices of it (a DTensor master per
  parameter, one slice per data rank). The module's ``.grad`` then is: ``None`` (stage 2, fp32
  accumulation); a buffer whose slice of this rank aliases the master's gradient (stage 1, fp32
  parameters, the first synced backward of the step: element-wise writes reach the optimizer);
  or this rank's own unreduced gradient (bf16 parameters, or a second synced backward), which
  holds nothing one process would. With one shard rank the slice is the whole gradient, flat.
* The precision plugin moves bf16 gradients into fp32 masters before ``on_before_optimizer_step``
  (under manual optimization after each backward), leaving ``.grad`` ``None``.
* SP's norm weights under ZeRO-3 hold partial sums until the step's sum over tp, which runs after
  ``on_after_backward``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_5d.gradient_reads import Found, GradientHere, GradientMap
from lightning_5d.parallel.regions import local_tensor


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class GradientPlaces:
    """This rank's gradient places for one fit (built once its optimizers exist)."""

    def __init__(self, module: nn.Module, applied: Any, precision: Any, zero_stage: int) -> None:
        self._tp, self._ep, self._pp = applied.tp, applied.ep, applied.pp
        self._slices = applied.zero.masters_by_name() if applied.zero is not None else {}
        self._masters = precision.masters_by_name(module) if precision is not None else {}
        self._shapes = {name: p.shape for name, p in module.named_parameters()}
        self._experts = self._ep is not None and self._ep.ep > 1
        # SP's norm weights under ZeRO-3: summed over tp after on_after_backward (sync_sequence_parallel)
        late = self._tp is not None and bool(applied.fsdp_units) and self._tp.has_partial_grads and self._pp is None
        self._tp_partial = frozenset(self._tp.sequence_partial) if late else frozenset()
        self.tp_sums_pending = False  # set from a backward's start to the sum over tp
        self._zero_stage = zero_stage
        self._slice_count = applied.zero.slice_count if applied.zero is not None else 1
        self._fsdp = bool(applied.fsdp_units)

    def where(self, name: str) -> GradientHere:
        if self._experts and self._ep.is_expert(name):
            return GradientHere.EXPERT_SHARD
        if self._tp is not None and self._tp.is_sharded(name):
            return GradientHere.TP_SHARD
        if name in self._slices and not self._slices[name][1]:
            return GradientHere.DATA_SLICE
        return GradientHere.WHOLE

    def locate(self, name: str, grad: Tensor | None) -> tuple[Found, Tensor | None]:
        """What a read of ``name``'s ``.grad`` (which returned ``grad``) stands for now."""
        if name in self._slices:
            master, whole = self._slices[name]
            reduced = master.grad if master is not None else None
            if reduced is None:  # not reduced yet (an accumulating micro-batch), or not in the optimizer
                return Found.READ, grad
            if whole:
                return Found.SUBSTITUTE, local_tensor(reduced).view(self._shapes[name])
            if grad is not None and _shares_storage(grad, local_tensor(reduced)):
                return Found.READ, grad  # ZeRO-1's buffer: this rank's chunk is the master's gradient
            return Found.ELSEWHERE, None
        master = self._masters.get(name)
        if master is not None and master.grad is not None:
            # Moved into the fp32 master; with .grad set too, the gradient is split between them
            # (fp32 accumulation: earlier micro-batches there, this one here).
            return (Found.SUBSTITUTE, master.grad) if grad is None else (Found.ELSEWHERE, None)
        return Found.READ, grad

    def tp_partial(self, name: str) -> bool:
        return self.tp_sums_pending and name in self._tp_partial

    def gradient_map(self) -> GradientMap:
        return GradientMap(
            where={name: self.where(name) for name in self._shapes},
            sizes={
                "tp": self._tp.size if self._tp is not None else 1,
                "ep": self._ep.ep if self._ep is not None else 1,
                "zero": self._zero_stage,
                "slices": self._slice_count,
            },
            locate=self.locate,
            tp_partial=self.tp_partial,
            stage=self._pp.rank if self._pp is not None else 0,
            stages=self._pp.pp if self._pp is not None else 1,
            tp_sums_late=bool(self._tp_partial),
            dtensor_grads=self._fsdp,
            moved_out=bool(self._masters) or any(whole for _, whole in self._slices.values()),
        )

    def pieces(self, module: nn.Module, names: list[str]) -> dict[str, Tensor]:
        """This rank's piece of each of ``names``' averaged gradient (collective over tp while SP's
        partial sums are pending: their copies are summed, the gradients left as they are)."""
        params = dict(module.named_parameters())
        out = {}
        for name in names:
            grad = params[name].grad
            if name in self._slices and self._slices[name][0] is not None and self._slices[name][0].grad is not None:
                grad = self._slices[name][0].grad  # a DTensor slice: its peers hold the others
            elif name in self._masters and self._masters[name].grad is not None:
                master = self._masters[name].grad
                grad = master if grad is None else master + grad.to(master.dtype)
            if grad is not None:
                out[name] = grad
        pending = sorted(n for n in out if self.tp_partial(n))
        if pending:
            flat = torch.cat([local_tensor(out[n]).reshape(-1).to(torch.float64) for n in pending])
            dist.all_reduce(flat, group=self._tp.group)
            for n, piece in zip(pending, flat.split([local_tensor(out[n]).numel() for n in pending])):
                out[n] = _like(out[n], piece.view(local_tensor(out[n]).shape))
        return out


def _like(grad: Tensor, local: Tensor) -> Tensor:
    """``local`` in ``grad``'s place: a DTensor again (its peers' shards still count) or as it is."""
    if not isinstance(grad, DTensor):
        return local
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                              stride=grad.stride())  # fmt: skip
