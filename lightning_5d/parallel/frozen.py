"""Parameters frozen at setup that the gradient machinery relies on staying frozen.

ZeRO-0..2 (``parallel/data/zero.py``) lay out their buckets, reduction hooks and optimizer
slices for the parameters that require gradients at setup, as DDP and Megatron's gradient
buffers do; tensor parallelism registers its sum over tp of partial gradients (sequence-parallel
norms, per-head q/k norms) on the same ones. A parameter frozen then (``requires_grad_(False)``
in ``__init__`` or ``configure_model``) and made trainable during training (a fine-tuning
schedule's unfreezing) would train on this rank's unreduced gradient: the ranks drift apart
and the numbers leave one process's without a word (measured: 1.7e-2 relative on the tiny
model's parameters two steps after unfreezing under ZeRO-1 over 2 ranks).

:class:`FrozenAtSetup` remembers those parameters and refuses, before the first backward's
gradients are reduced or stepped, once one of them requires gradients. ZeRO-3 (FSDP2) reduces
whichever parameters have gradients, and the tp sums run after its backward on every gradient
there is, so nothing is watched under it. Freezing a trainable parameter later is fine
everywhere: it simply gets no gradient, which every engine handles as a parameter no rank used.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class FrozenParameterError(RuntimeError):
    """A parameter frozen at setup requires gradients now, where the layout cannot train it."""


@dataclass(frozen=True)
class FrozenAtSetup:
    """The watched parameters (name, parameter) and why each set is watched."""

    params: tuple[tuple[str, nn.Parameter], ...]
    reasons: tuple[str, ...]

    @classmethod
    def watch(cls, module: nn.Module, zero_stage: int | None, tp_partial: set[str] | None) -> FrozenAtSetup | None:
        """``zero_stage``: the ZeRO-0..2 engines' stage where they exist; ``tp_partial``: the names
        whose partial gradients tp sums through hooks on the trainable ones (None: no hooks)."""
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        watched: dict[int, tuple[str, nn.Parameter]] = {}
        reasons = []
        if zero_stage is not None and frozen:
            watched.update((id(p), (n, p)) for n, p in frozen)
            reasons.append(f"zero={zero_stage} reduces and shards only the gradients of parameters trainable at "
                           f"setup, so these would step on this rank's own gradient and the ranks would drift "
                           f"apart")  # fmt: skip
        partial = [(n, p) for n, p in frozen if tp_partial and n in tp_partial]
        if partial:
            watched.update((id(p), (n, p)) for n, p in partial)
            reasons.append("tensor parallelism sums the partial gradients of replicated norms over tp only for "
                           "parameters trainable at setup, so these would step on this rank's partial gradient")  # fmt: skip
        return cls(tuple(watched.values()), tuple(reasons)) if watched else None

    @classmethod
    def without_masters(cls, module: nn.Module, params: list[nn.Parameter]) -> FrozenAtSetup | None:
        """The frozen bf16 parameters this fit's optimizers hold without an fp32 master
        (``FiveDPrecision.frozen_without_master``, made when the optimizers are)."""
        held = {id(p) for p in params}
        watched = tuple((n, p) for n, p in module.named_parameters() if id(p) in held)
        reason = ("bf16 mixed precision made fp32 optimizer masters only for parameters trainable when the "
                  "optimizers were set up, so these would be stepped in bf16")  # fmt: skip
        return cls(watched, (reason,)) if watched else None

    def check(self) -> None:
        """Raise :class:`FrozenParameterError` if a watched parameter requires gradients now."""
        woke = [n for n, p in self.params if p.requires_grad]
        if not woke:
            return
        shown = ", ".join(woke[:4]) + (f" and {len(woke) - 4} more" if len(woke) > 4 else "")
        raise FrozenParameterError(
            f"{len(woke)} parameter(s) frozen when FiveDStrategy set up training now require gradients ({shown}), "
            f"but {'; and '.join(self.reasons)}. Either use zero=3, which reduces whichever parameters have "
            f"gradients and keeps fp32 shards; or leave them trainable from the start and hold them still with "
            f"lr=0 in their own optimizer parameter group until they should train; or unfreeze them before "
            f"setup (a later Trainer's fit sets up anew where data parallelism alone ran; a module that tp, pp, cp "
            f"or ep cut keeps its first setup)."
        )


def refuse_finetuning_callbacks(callbacks: list, optimizers: list, module: nn.Module, zero: int) -> None:
    """Refuse Lightning's fine-tuning callbacks (``BackboneFinetuning``, any ``BaseFinetuning``)
    where the optimizer does not hold the module's own parameters.

    Those callbacks map every optimizer parameter to its module name by identity at each epoch
    start, and add a parameter group of module parameters when they unfreeze. Under zero=1/2
    the optimizer holds flat slices of the parameters, and with bf16 parameters fp32 masters:
    Lightning's callback then failed inside its own code with a bare ``KeyError`` on a DTensor.
    """
    from lightning.pytorch.callbacks import BaseFinetuning

    finetuning = [type(c).__name__ for c in callbacks if isinstance(c, BaseFinetuning)]
    if not finetuning:
        return
    own = {id(p) for p in module.parameters()}
    if all(id(p) in own for opt in optimizers for group in opt.param_groups for p in group["params"]):
        return
    held = "flat fp32 slices of each parameter (ZeRO-1/2)" if zero in (1, 2) else "fp32 masters of the bf16 parameters"
    raise FrozenParameterError(
        f"{', '.join(finetuning)} maps the optimizer's parameters to the module's by identity and adds the module's "
        f"parameters as a new group when it unfreezes them, but under zero={zero} the optimizer holds {held}. "
        f"Use zero=3 with fp32 parameters (bf16-mixed keeps them fp32), which hands the optimizer the module's own "
        f"(sharded) parameters and trains the unfreezing as one process does; or leave the backbone trainable "
        f"from the start and hold it still with lr=0 in its own parameter group until it should train."
    )
