"""Lightning's ``grad_norm`` with one process's numbers under every layout.

``lightning.pytorch.utilities.grad_norm(module, norm_type)`` (logged from
``on_before_optimizer_step``, Lightning's way to track gradient norms) reads each parameter's
``.grad`` on the calling rank. Under tp that is a shard, under ZeRO-1/2 a partly reduced buffer
or ``None``, under pp only this stage's parameters exist: the logged numbers would be wrong or
missing, so the strategy refuses them (``gradient_reads``). :func:`grad_norm` returns the same
keys and values one process's ``grad_norm`` returns, on every rank (rank 0 logs the other
stages' parameters too), from the pieces each rank holds: one vector of per-parameter p-th
powers summed over each group that splits gradients (``parallel/grad_norm.per_parameter_norms``).
"""

from __future__ import annotations

from typing import Union

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn

from lightning_5d.parallel.grad_norm import norm_of_norms
from lightning_5d.strategy import FiveDStrategy


def grad_norm(
    pl_module: LightningModule,
    norm_type: Union[float, int, str],
    group_separator: str = "/",
    module: nn.Module | str | None = None,
) -> dict[str, Tensor]:
    """The norm of each parameter's gradient and their total norm, as one process computes them.

    Call it on every rank (it is a collective under FiveDStrategy), e.g.
    ``self.log_dict(lightning_5d.grad_norm(self, 2))`` in ``on_before_optimizer_step``. Keys are
    Lightning's (``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``); ``module``: a submodule of
    ``pl_module`` whose parameters alone count, named relative to it, as
    ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` names them, or its dotted name
    (``"model.layers.3"``: under pp a stage holds only its own blocks, but every rank must call
    this, and a name works on all of them). Without FiveDStrategy this is Lightning's ``grad_norm``.
    """
    strategy = pl_module.trainer.strategy
    if not isinstance(strategy, FiveDStrategy):
        within = pl_module.get_submodule(module) if isinstance(module, str) else module
        return lightning_grad_norm(pl_module if within is None else within, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms = strategy.parameter_grad_norms(norm_type)  # first: every rank joins it, whatever it holds
    prefix = _prefix_of(pl_module, module)
    chosen = {n[len(prefix) :]: v for n, v in norms.items() if n.startswith(prefix)}
    out = {f"grad_{norm_type}_norm{group_separator}{n}": v.float() for n, v in chosen.items()}
    if chosen:
        out[f"grad_{norm_type}_norm_total"] = norm_of_norms(chosen.values(), norm_type).float()
    return out


def _prefix_of(pl_module: LightningModule, module: nn.Module | str | None) -> str:
    if module is None or module is pl_module or module == "":
        return ""
    if isinstance(module, str):
        return f"{module}."
    for name, m in pl_module.named_modules():
        if m is module:
            return f"{name}."
    raise ValueError(
        f"grad_norm(pl_module, ..., module=...) needs a submodule of pl_module; {type(module).__name__} is not one "
        f"on this rank (under pp a stage holds only its own blocks: give the submodule's dotted name instead)."
    )
