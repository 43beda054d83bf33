"""Adapter-wrapped projections (LoRA-style), recognized by their shapes, and refused with the reason.

A fine-tuning library (peft's LoRA, or a hand-written adapter) puts a module in a projection's
place that holds the original linear layer beside a low-rank branch: ``base(x) + B(A(x))`` with
``A: I -> r`` and ``B: r -> O`` for a base ``I -> O``, ``r < min(I, O)``. Names differ between
libraries (peft: ``base_layer``, ``lora_A.default``, ``lora_B.default``), so a wrapper is found
by what it holds: every linear layer under it (3 to ``MAX_LINEARS`` of them) is the base or one
of such branches. Shapes cannot tell a module whose only linears are ``I -> O`` and an ``I -> r -> O``
chain used otherwise; the dimensions refused for it would not map it either (its projection slot
holds no linear layer).

Tensor parallelism cuts plain projections; a wrapped one would need its branch cut to match
(``B``'s rows with a column-cut base; ``A``'s columns, and a sum over tp, with a row-cut one),
which it does not do yet, and pointing a ``model_plan`` at the base leaves the branch whole (a
shape mismatch in the user's forward). Discovery therefore refuses a model with wrappers for the
dimensions that need a plan, naming them, instead of proposing a ``model_plan``
that cannot work. Data parallelism needs no plan: adapters train there as in one process (tested
at ZeRO-1 and ZeRO-3: tests/distributed/test_frozen_parameters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from torch import nn

from lightning_5d.plan import kinds


# A wrapper holds its base and its adapters' (A, B) pairs (up to 8 adapters); a module holding
# more linears (a block, the model) is not a wrapper, and its count stops there.
MAX_LINEARS = 17


@dataclass(frozen=True)
class AdapterWrapper:
    """``path`` wraps the linear ``base`` (relative to it) with low-rank ``branches`` ((A, B) pairs)."""

    path: str
    kind: str  # the wrapper's class name
    base: str
    branches: tuple[tuple[str, str], ...]
    ranks: tuple[int, ...]  # each branch's r

    def describe(self) -> str:
        pairs = ", ".join(f"{a} -> {b} (rank {r})" for (a, b), r in zip(self.branches, self.ranks))
        return f"{self.path} ({self.kind}: linear {self.base} with the low-rank branch {pairs})"


def adapter_wrapper(path: str, module: nn.Module) -> AdapterWrapper | None:
    """``module`` as an adapter wrapper, or None: it is not itself a linear layer and every linear
    under it is one base ``I -> O`` or part of an ``I -> r -> O`` pair with ``r < min(I, O)``."""
    if kinds.is_projection(module):
        return None
    # Stop counting past MAX_LINEARS: a block's or the whole model's modules are not read to the end.
    linears = list(islice(((n, m) for n, m in module.named_modules() if n and kinds.is_projection(m)), MAX_LINEARS + 1))
    if not 3 <= len(linears) <= MAX_LINEARS:  # a base and at least one pair; a block holds more
        return None
    for base_name, base in linears:
        fan_in, fan_out = kinds.in_features(base), kinds.out_features(base)
        low = min(fan_in, fan_out)
        rest = [(n, m) for n, m in linears if n != base_name]
        downs = [(n, kinds.out_features(m)) for n, m in rest if kinds.in_features(m) == fan_in and kinds.out_features(m) < low]
        ups = [(n, kinds.in_features(m)) for n, m in rest if kinds.out_features(m) == fan_out and kinds.in_features(m) < low]
        # Every other linear is an A (I -> r) or a B (r -> O), with as many of each rank (several adapters,
        # paired in name order: peft keys both ModuleDicts by the adapter's name).
        if downs and len(downs) + len(ups) == len(rest) and sorted(r for _, r in downs) == sorted(r for _, r in ups):
            ups_left = list(ups)
            pairs = []
            for a, rank in downs:
                b = next(u for u in ups_left if u[1] == rank)
                ups_left.remove(b)
                pairs.append((a, b[0]))
            return AdapterWrapper(path, type(module).__name__, base_name, tuple(pairs), tuple(r for _, r in downs))
    return None


def adapter_wrappers(root: nn.Module) -> list[AdapterWrapper]:
    """The outermost adapter wrappers in ``root``."""
    found: list[AdapterWrapper] = []
    for path, module in root.named_modules():
        # named_modules walks depth first: a wrapper's own modules come right after it.
        if found and path.startswith(found[-1].path + "."):
            continue
        wrapper = adapter_wrapper(path, module)
        if wrapper is not None:
            found.append(wrapper)
    return found


def refusal(wrappers: list[AdapterWrapper]) -> str:
    """Why a model with these wrappers is not mapped, and what trains it."""
    first = wrappers[0]
    more = f" and {len(wrappers) - 1} more like it" if len(wrappers) > 1 else ""
    return (
        f"it holds adapter-wrapped projections: {first.describe()}{more}. The dimensions that need the "
        f"model's plan (tensor, context, pipeline and expert parallelism, FP8) map plain projections only, and an "
        f"adapter's branch would need its own cut, which they do not make yet. Train the adapters under data "
        f"parallelism alone (zero=0..3 needs no plan; the frozen base weights hold no gradient or optimizer state), "
        f"or merge the adapters into the base weights first (peft: merge_and_unload())"
    )
