"""fp32 master copies for low-precision parameters the optimizer would otherwise step itself.

ZeRO-1/2 already hand the optimizer fp32 master slices and ZeRO-3 keeps fp32 shards under
FSDP2's mixed-precision policy; this covers the rest (ZeRO-0, or no data-parallel peers):
each bf16 parameter in an optimizer is replaced there by an fp32 copy. After the backward
its gradient moves into the copy (the bf16 one is freed as it goes, so the step holds fp32
gradients, not both), the optimizer updates the copy, and the result is rounded back into
the bf16 parameter the model computes with.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer.state:
            raise RuntimeError("master weights must be made before the optimizer's first step.")
        self.optimizer = optimizer
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model parameter, fp32 master)
        # Frozen low-precision parameters the optimizer holds without a master: a master would be a
        # full fp32 copy never stepped; unfreezing one is refused (lightning_5d/parallel/frozen.py).
        self.frozen: list[nn.Parameter] = []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype not in LOW_PRECISION:  # ZeRO-1/2 masters and ZeRO-3 shards are fp32 already
                    continue
                if not p.requires_grad:
                    self.frozen.append(p)
                    continue
                master = nn.Parameter(p.detach().float())
                group["params"][i] = master
                self._pairs.append((p, master))
        self._param_of = {id(m): p for p, m in self._pairs}
        self._hook = optimizer.register_step_post_hook(lambda *_: self.copy_to_model())

    def __len__(self) -> int:
        return len(self._pairs)

    def param_of(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter behind an optimizer parameter (a master or itself)."""
        return self._param_of.get(id(p), p)

    def move_grads(self) -> None:
        """Add each bf16 gradient into its master's fp32 one and free it. Once per step, or after
        every micro-batch's backward for fp32 accumulation (``zero_grad`` clears the masters)."""
        for p, master in self._pairs:
            if p.grad is None:
                continue
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, master in self._pairs:
            p.copy_(master)

    @torch.no_grad()
    def refresh(self) -> None:
        """Masters from the model's parameters, after their values were loaded."""
        for p, master in self._pairs:
            master.copy_(p)

    @contextmanager
    def as_model_params(self) -> Iterator[None]:
        """The optimizer keyed by the model's parameters for as long as the block runs, so
        torch's optimizer state-dict helpers (which match parameters by identity) see names."""
        swap = {id(m): p for p, m in self._pairs}
        back = {id(p): m for p, m in self._pairs}
        # For the block, each parameter shows its master's fp32 values: torch's load_state_dict
        # casts state to the dtype of the parameter it is keyed by, and Adam's moments must not
        # pass through bf16.
        bf16 = [(p, p.data) for p, _ in self._pairs]
        for p, master in self._pairs:
            p.data = master.data
        self._rekey(swap)
        try:
            yield
        finally:
            self._rekey(back)
            for p, data in bf16:
                p.data = data

    def _rekey(self, mapping: dict[int, torch.Tensor]) -> None:
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        state = {}
        for key, value in opt.state.items():
            state[mapping.get(id(key), key)] = value
        opt.state.clear()
        opt.state.update(state)

    def remove(self) -> None:
        self._hook.remove()
