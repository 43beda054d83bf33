"""Move a generator on as a whole-tensor draw would, holding one chunk of the tensor.

The recorder (:mod:`.record`) must leave the generator where an eager CPU build leaves it, so
each random call made on the meta device is drawn once more on CPU and its numbers thrown
away. Drawn whole, that costs the tensor's full size: the 32000 x 1536 embedding of a 0.5 B
Llama is 188 MiB, on every rank, while the model is built. That is above the rank's share
whenever the share is the smaller (small models, many ranks): 4 ranks of a 74 M-parameter
model (94 MiB embedding, 71 MiB share) peaked at 98.9 MiB above the baseline against
Lightning's 83.5; in chunks, 83.7 (benchmarks/RESULTS.md "stop 35").

Where the call's one draw is ``uniform_`` or ``normal_`` over a whole contiguous floating
tensor, :func:`advance` draws it in chunks into one small buffer instead. The CPU kernels
consume the generator chunk by chunk exactly as over the whole tensor (the draw order in
:mod:`.chunks`): ``uniform_`` one number per element in order, so any split is exact;
``normal_`` on >= 16 elements one uniform per element plus 16 more when ``numel % 16 != 0``,
so chunks of a multiple of 16 with a last chunk of >= 16 elements consume what the whole does.

What a call draws is observed, not assumed from its name: :func:`observe` runs it once on
meta stand-ins under a dispatch mode that notes every seeded aten call
(``torch.Tag.nondeterministic_seeded``); ``torch.rand`` / ``torch.randn`` count as the
``uniform_`` / ``normal_`` their CPU kernels make over the new tensor. Anything else (a second
draw, ``randint`` / ``randperm`` / ``bernoulli_``, an integer or non-contiguous draw, an
``nn.init`` function that returns early on meta without any aten call) is drawn whole, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_5d.heap import scratch_storage
from lightning_5d.materialize.trees import leaves, map_leaves

CHUNK_BYTES = 2**20  # 1 MiB: the overhead above the share; the draws cost the same in any chunking
aten = torch.ops.aten
DRAWS = frozenset({aten.uniform_.default, aten.normal_.default})
# Random factories whose CPU kernel is an empty tensor then one of the draws above over all of it
# (ATen's rand / randn); tests/unit/materialize/test_draws.py checks the generator lands alike.
_FACTORIES = {
    aten.rand.default: (aten.uniform_.default, (0.0, 1.0)), aten.rand.generator: (aten.uniform_.default, (0.0, 1.0)),
    aten.randn.default: (aten.normal_.default, (0.0, 1.0)), aten.randn.generator: (aten.normal_.default, (0.0, 1.0)),
}  # fmt: skip
_GROUP = 16  # normal_'s Box-Muller group: chunks start at multiples of it, the last holds >= 16


@dataclass(frozen=True)
class Draw:
    """One whole-tensor ``uniform_`` / ``normal_``: enough to consume the generator as it does."""

    func: Any  # aten.uniform_.default or aten.normal_.default
    numel: int
    dtype: torch.dtype
    args: tuple  # the call's arguments after the tensor (bounds, mean, std)
    kwargs: dict  # generator= among them where the call names one


class AtenCalls(TorchDispatchMode):
    """Notes every aten call made under it: (op, args, kwargs, result)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _stand_in(x: Any) -> Any:
    """A fresh meta tensor with ``x``'s geometry (the call's writes then touch nothing of the model's)."""
    if not (isinstance(x, Tensor) and x.is_meta):
        return x
    storage = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
    return torch.empty(0, dtype=x.dtype, device="meta").set_(storage, x.storage_offset(), x.shape, x.stride())


def observe(func: Callable, args: tuple, kwargs: dict) -> Draw | None:
    """The draw ``func(*args, **kwargs)`` makes on its meta tensors, if it is exactly one
    ``uniform_`` / ``normal_`` over the whole of a contiguous floating tensor; else None."""
    flat = leaves((args, kwargs))
    generators = [g for g in flat if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators]
    if not any(isinstance(x, Tensor) for x in flat) and kwargs.get("device") is None:
        kwargs = {**kwargs, "device": torch.device("meta")}  # a factory: the recording's default device
    seen = AtenCalls()
    try:
        # Meta draws consume nothing; the generators are restored anyway, in case the call
        # draws on a real tensor of its own along the way (it is then drawn whole, below).
        # No torch-function mode sees this run: the recorder may still be on the stack (the
        # nn.init functions it wraps call it directly), and nothing here is the model's.
        with torch._C.DisableTorchFunction(), torch.random.fork_rng(devices=[]), torch.no_grad(), seen:
            func(*map_leaves(_stand_in, args), **map_leaves(_stand_in, kwargs))
    except Exception:  # noqa: BLE001 - whatever meta cannot run is drawn whole, where it reports itself
        return None
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
    seeded = [call for call in seen.calls if torch.Tag.nondeterministic_seeded in call[0].tags]  # consume a generator
    if len(seeded) != 1:
        return None
    op, cargs, ckwargs, out = seeded[0]
    if op in _FACTORIES:  # torch.rand / torch.randn: the draw over the tensor it makes
        op, bounds = _FACTORIES[op]
        target, rest = out, (bounds, {"generator": ckwargs.get("generator")})
    else:
        target, rest = (cargs[0] if cargs else None), (tuple(cargs[1:]), dict(ckwargs))
    if op not in DRAWS or not isinstance(target, Tensor) or not target.is_meta:
        return None
    if not target.is_floating_point() or not target.is_contiguous() or target.numel() == 0:
        return None  # (an empty draw consumes nothing: drawn "whole" at no cost)
    if any(isinstance(x, Tensor) for x in leaves(rest)):
        return None
    return Draw(op, target.numel(), target.dtype, *rest)


def chunk_sizes(numel: int, per: int) -> list[int]:
    """``numel`` cut into chunks of ``per`` (a multiple of 16) and a last one of 16 to ``per + 15``
    elements (or the whole, if smaller): the split under which ``normal_`` draws what it draws whole."""
    sizes, rest = [], numel
    while rest > 0:
        n = rest if rest < per + _GROUP else per
        sizes.append(n)
        rest -= n
    return sizes


def advance(draw: Draw, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Consume the generator as ``draw`` over its whole tensor would, drawing at most
    ``chunk_bytes`` (plus one group of 16) at a time into a buffer that is thrown away."""
    itemsize = draw.dtype.itemsize
    per = max(_GROUP, chunk_bytes // itemsize // _GROUP * _GROUP)
    sizes = chunk_sizes(draw.numel, per)
    buffer = torch.empty(0, dtype=draw.dtype, device="cpu").set_(scratch_storage(max(sizes) * itemsize), 0, (max(sizes),), (1,))
    with torch.no_grad():
        for n in sizes:
            draw.func(buffer[:n], *draw.args, **draw.kwargs)
