"""Each live (parallel) piece run once more, alone, on the input it received in the probe.

The gradient check needs a graph from a piece's output to its own parameters. The probe
forward builds none (it runs without gradients); instead each piece's own ``forward`` runs
again on its recorded input, inside the probe's context (precision autocast, FP8 computing
in bf16, cp's sequence shard and attention routing), and its backward runs there too:

* activation checkpointing recomputes the block in that backward, so the recomputation
  sees the same context as the forward (outside it, cp's ring attention would not run and
  torch refuses the recomputation);
* under ZeRO-3 the units holding the piece's parameters are gathered for it
  (:func:`gathered`): one unit (a block, the embedding, the final norm and head) at a time,
  never the model; the forward then uses FSDP2's unsharded parameters, whose gradients
  are the ones training reduce-scatters;
* the recorded input is detached, so the backward reaches no earlier piece and fires no
  collective of another piece.

``module.forward`` is called, not ``module(...)``: the recorded input already passed the
piece's own pre-hooks (tp's sequence scatter, the pipeline's received activation), and its
own post-hooks are layout only (a sequence gather whose backward is the rank's chunk, the
head's ``DTensor`` wrapper) or the pipeline's stage boundary, which must not fire here;
FSDP2's hooks on the piece are replaced by :func:`gathered`. Hooks inside the piece (tp's
regions, cp's attention routing) run as in the probe.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_5d.module_mode import eval_mode
from lightning_5d.verify.grads import local_grads, summed


@dataclass
class ParallelGrads:
    """The parallel side of the gradient check: a live piece run again on its probe input,
    differentiated, and its gradients summed as training sums them (:mod:`.grads`)."""

    context: Callable[[], ContextManager[Any]]  # the probe's context, entered again for each piece
    owners: dict[int, FSDPModule]  # parameter id -> ZeRO-3 unit (:func:`unit_owners`; empty without ZeRO-3)
    tp: Any | None = None  # the strategy's TensorParallel
    cp: Any | None = None  # the strategy's ContextParallel
    zero3: bool = False
    roots: Sequence[FSDPModule] = ()  # the ZeRO-3 root units (:func:`fsdp_roots`), reset after each piece

    def of(
        self, live: nn.Module, prefix: str, args: tuple, kwargs: dict, names: list[str]
    ) -> dict[str, Tensor] | None:
        """``names``' gradients (relative to the piece at ``prefix``) at this rank's shape, summed
        over cp (and tp where training sums them); None when a parameter stays a ``DTensor``
        once gathered (not one of this model's ZeRO-3 units).

        A collective (ZeRO-3 gathers, tp/cp inside the piece, the sums): every rank holding the
        piece calls it in the same order."""
        with eval_mode(live), gathered(live, self.owners, self.roots):  # eval as in the probe: dropout off
            params = dict(live.named_parameters())
            if any(isinstance(params[n], DTensor) for n in names):
                return None
            with self.context(), torch.enable_grad():
                # The backward inside the context too: activation checkpointing recomputes there.
                grads = local_grads(rerun(live, args, kwargs), [params[n] for n in names])
            del params
        # Under ZeRO-3 training sums tp's partial gradients after the backward (FSDP2's parameters carry no hooks).
        partial = self.tp.sequence_partial if self.tp is not None and self.zero3 else ()
        return summed(dict(zip(names, grads)), prefix, self.tp, self.cp, partial)


def unit_owners(root: nn.Module) -> dict[int, FSDPModule]:
    """Each parameter (by ``id``) of a ZeRO-3 model -> the FSDP2 unit that shards it (the
    innermost one holding it: an inner unit's parameters are not its parent's)."""
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    owners: dict[int, FSDPModule] = {}
    sizes: dict[int, int] = {}
    for unit in units:
        params = list(unit.parameters())
        for p in params:
            if id(p) not in owners or len(params) < sizes[id(p)]:
                owners[id(p)], sizes[id(p)] = unit, len(params)
    return owners


@contextmanager
def gathered(live: nn.Module, owners: dict[int, FSDPModule], roots: Sequence[FSDPModule] = ()) -> Iterator[None]:
    """``live``'s parameters unsharded while inside (FSDP2 registers the unsharded tensors on
    the modules), every unit resharded after (``roots``: the model's root units). A collective
    over each unit's data ranks: every rank that holds the piece enters it in the same order.
    Nothing to do without ZeRO-3."""
    units: list[FSDPModule] = []
    for p in live.parameters():
        unit = owners.get(id(p))
        if unit is not None and all(unit is not u for u in units):
            units.append(unit)
    try:
        for unit in units:
            unit.unshard()  # a grouped unit (a container block's sub-layers) gathers its group
        yield
    finally:
        for unit in units:
            unit.reshard()
        # The rerun calls the piece's inner units as modules: their FSDP2 hooks ran a forward and a
        # backward outside any root's iteration (no root forward, no final callback), which leaves
        # groups in FORWARD state, where ``reshard()`` does nothing for a unit training keeps gathered
        # after its forward, and the backward's pre-hooks gather ahead the unit that ran before in the
        # probe, of another piece. Left so, their parameters stayed registered unsharded and the
        # optimizer, built after setup, held those instead of the shards: tests/zoo's
        # moduledict_layers under tp2 x pp2 x ZeRO-3 (one unit per linear and norm on the last
        # stage) trained nothing there, silently. Each root's recovery reshards every unit.
        for root in roots:
            root.reset_iter_state()


def rerun(live: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``live``'s own forward on its recorded (detached) input; call with gradients enabled."""
    return live.forward(*without_cache(args), **without_cache(kwargs))


def without_cache(value: Any) -> Any:
    """``value`` with any key/value cache (Hugging Face's ``Cache``) replaced by None: the
    probe's blocks already filled it, and a block handed it again would attend over those
    keys too. A block given none computes the same attention without storing it."""
    if any(c.__name__ == "Cache" for c in type(value).__mro__):
        return None
    if isinstance(value, tuple):
        return tuple(without_cache(v) for v in value)
    if isinstance(value, list):
        return [without_cache(v) for v in value]
    if isinstance(value, dict):
        return {k: without_cache(v) for k, v in value.items()}
    return value
