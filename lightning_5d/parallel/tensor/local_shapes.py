"""Replay an attention forward's full-width reshapes with this tp rank's sizes.

Discovery observed, at full size, which ``view`` / ``reshape`` / ``split`` calls of an
attention forward take a full head count or width (:mod:`lightning_5d.plan.shape_sites`).
Under tp the forward runs under :class:`_LocalShapes`, which meets the same calls in the
same order and, where the model's own sizes do not fit the rank's tensor, gives the call
the observed sizes with each head count and width divided by tp (the batch-shaped sizes as
the call has them). nanoGPT's attention then runs on its rank's heads unchanged:

    B, T, C = x.size()                          C = 64 (the input is whole under tp)
    q, k, v = self.c_attn(x).split(64, dim=2)   -> split(32): this rank's [q | k | v]
    q.view(B, T, self.n_head, C // self.n_head) -> view(B, T, 4 / tp, 16)
    y.transpose(1, 2).contiguous().view(B, T, C) -> view(B, T, 64 / tp)

A call whose own sizes already fit (attributes tp divided, ``-1`` heads) is left as it is,
and so is one the observed sizes do not fit either (it fails as it would have, and the
plan verifier reports it).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.plan.shape_sites import ShapeSite, SiteCounter, shape_call, with_sizes


def fits(op: str, tensor: Tensor, sizes: tuple[int, ...], dim: int, pieces: int) -> bool:
    """Whether ``tensor`` can take the call with ``sizes`` (and a split gives ``pieces`` tensors)."""
    if op == "split":
        length = tensor.size(dim)
        if len(sizes) > 1:
            return sum(sizes) == length and len(sizes) == pieces
        return sizes[0] > 0 and -(-length // sizes[0]) == pieces
    known = [s for s in sizes if s != -1]
    product = math.prod(known)
    if len(known) == len(sizes):
        return product == tensor.numel()
    return product > 0 and tensor.numel() % product == 0


def _split_dim(args: tuple, kwargs: dict) -> int:
    return kwargs.get("dim", args[2] if len(args) > 2 else 0)


class _LocalShapes(TorchFunctionMode):
    def __init__(self, sites: dict[tuple[str, int, int], ShapeSite], tp: int) -> None:
        super().__init__()
        self.sites, self.tp = sites, tp
        self.counter = SiteCounter()
        self.rewrote = 0  # calls given local sizes in this forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = shape_call(func, args, kwargs)
        if found is not None:
            site = self.sites.get(self.counter.key())
            if site is not None and site.op == found[0] and len(site.sizes) == len(found[1]):
                args = self._localized(site, found[1], args, kwargs)
        return func(*args, **kwargs)

    def _localized(self, site: ShapeSite, sizes: tuple[int, ...], args: tuple, kwargs: dict) -> tuple:
        tensor = args[0]
        dim = _split_dim(args, kwargs) if site.op == "split" else 0
        if fits(site.op, tensor, sizes, dim, site.pieces):
            return args
        local = site.local_sizes(sizes, self.tp)
        if local == sizes or not fits(site.op, tensor, local, dim, site.pieces):
            return args
        self.rewrote += 1
        return with_sizes(site.op, args, local)


def localize_shapes(attention: nn.Module, sites: tuple[ShapeSite, ...], tp: int) -> None:
    """Run ``attention``'s forward under :class:`_LocalShapes` (a fresh count per call).

    A forward that completed without a call needing local sizes (the model's own sizes fit:
    tp divided the attributes it reshapes with) will never need one, as the calls are the
    same every step: later calls then skip the mode and its per-op dispatch. The wrapper
    stays in place (a wrapper set around it later, cp's, keeps calling it)."""
    if not sites:
        return
    by_key = {site.key: site for site in sites}
    original = attention.forward
    needed = [True]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not needed[0]:
            return original(*args, **kwargs)
        mode = _LocalShapes(by_key, tp)
        with mode:
            out = original(*args, **kwargs)
        needed[0] = mode.rewrote > 0
        return out

    attention.forward = forward
