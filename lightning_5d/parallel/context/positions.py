"""Giving every token its global position when the sequence is cut over the cp ranks.

A model called on a shard would number its tokens 0..S/cp−1; rotary (or learned) position
embeddings must instead see each token's place in the whole sequence. Two routes:

* **position_ids**: the backbone (the deepest module holding the blocks whose ``forward``
  takes ``position_ids``: Hugging Face ``*Model``, the reference ``LlamaModel``) gets the
  shard's global positions whenever the caller passes none. Positions the caller does pass
  come from the batch and were cut with it.
* **length-sliced RoPE cache**: a rotary module called as ``rope(x, seq_len=n)`` that
  returns the first ``n`` rows of a cos/sin cache is asked for the whole sequence and
  answers with the rows of this shard's positions.
* **observed reads** (a model without either): where discovery's probe saw the forward read
  its positions (:mod:`lightning_5d.plan.position_reads`: an embedding of ``arange(n)``, a
  table read as its first n rows, ``torch.arange(n)`` made in a module's forward such as the
  rotary angles of a hand-written attention, or nothing at all for NoPE) and proved that,
  given the shard's positions there, each token computes what it computes in the whole
  sequence. Zig-zag shards are not one range: rank r's positions are chunks r and 2·cp−1−r.

A model offering none of these is refused at setup with what it must expose.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import Tensor, nn

from lightning_5d.parallel.context.batch import ContextParallelError
from lightning_5d.parallel.context.state import ContextState
from lightning_5d.plan.model_plan import ModelPlan
from lightning_5d.plan.position_reads import PositionRead, PositionReadKind, redirect_reads


def _parameters(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def find_backbone(module: nn.Module, plan: ModelPlan) -> tuple[str, nn.Module] | None:
    """The deepest ancestor of the blocks whose forward takes ``position_ids``."""
    parts = plan.blocks.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        candidate = module.get_submodule(path)
        if "position_ids" in _parameters(candidate.forward):
            return path, candidate
    return None


def _length_sliced_rotaries(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in module.named_modules()
        if "rotary" in type(m).__name__.lower() and "seq_len" in _parameters(m.forward)
    ]


def route_positions(
    cp: ContextState, module: nn.Module, plan: ModelPlan, more: list[tuple[str, nn.Module]] = ()
) -> str:  # fmt: skip
    """Install the route; returns a one-line description. Raises if the model offers none.

    ``more``: other backbones that must get positions too (every Hugging Face model routed
    to ring attention: a reference or teacher model next to the trained one).
    """
    backbone = find_backbone(module, plan)
    if backbone is not None:
        targets = {id(backbone[1]): backbone}
        for path, extra in more:
            if "position_ids" in _parameters(extra.forward):
                targets.setdefault(id(extra), (path, extra))
        for path, target in targets.values():
            index = _parameters(target.forward).index("position_ids")
            hook = functools.partial(_inject, cp, path or "the module", index)
            cp.undo.append(target.register_forward_pre_hook(hook, with_kwargs=True).remove)
        names = ", ".join(f"{path or type(module).__name__}.forward" for path, _ in targets.values())
        return f"global position_ids into {names}"
    rotaries = _length_sliced_rotaries(module)
    if rotaries:
        for _, rotary in rotaries:
            _slice_rotary(cp, rotary)
        return f"global rows of the RoPE cache in {', '.join(n for n, _ in rotaries)}"
    if plan.uses_positions is not None:
        # Observed at discovery (plan/position_reads.py): with these reads given the shard's
        # positions, every token computes what it computes in the whole sequence outside
        # attention, which ring attention makes global. No read at all: NoPE.
        if plan.chain_assumed:
            _follow_the_chain(cp, module, plan)
        if not plan.position_reads:
            return "none needed (observed: the model reads no position; NoPE)"
        current = lambda: cp.current.positions if cp.current is not None else None  # noqa: E731
        cp.undo.extend(redirect_reads(module, plan.position_reads, current, cp.wrap_forward))
        return "global positions into " + _describe_reads(plan.position_reads)
    owner = plan.blocks.rsplit(".", 1)[0] if "." in plan.blocks else ""
    owner_cls = type(module.get_submodule(owner)).__name__
    raise ContextParallelError(
        f"cp={cp.size} cuts the sequence, so each token needs its global position, but {owner_cls}.forward "
        f"(the module holding {plan.blocks}) takes no position_ids, no rotary module with a seq_len argument "
        f"was found, and the probe could not show where the model reads positions (an embedding of arange(n), "
        f"a table read as its first n rows, torch.arange(n) made in a module's forward such as rotary angles, or "
        f"none at all). Add a position_ids argument to {owner_cls}.forward and build the position embedding "
        f"(RoPE cos/sin or learned) from it, defaulting to arange(seq_len) when it is None; or use cp=1."
    )


def _describe_reads(reads: tuple[PositionRead, ...]) -> str:
    """One entry per read; arange sites made in many modules (every block's attention) once, with their count."""
    parts: dict[str, list[str]] = {}
    for read in reads:
        if read.kind is PositionReadKind.ARANGE:
            sites = ", ".join(site.describe() for site in read.sites)
            parts.setdefault(sites, []).append(read.path or "the model")
        else:
            parts[read.describe()] = []
    return ", ".join(
        what if not where else f"{what} in {where[0]}" + (f" and {len(where) - 1} more" if len(where) > 1 else "")
        for what, where in parts.items()
    )


def _follow_the_chain(cp: ContextState, module: nn.Module, plan: ModelPlan) -> None:
    """The root has no forward, so the probe ran its parts as a chain; each step must call them so:
    embedding -> blocks -> final norm -> head, each on the previous one's output unchanged (code of
    the LightningModule's own between them, which the probe did not see, could add positions).
    Checked up to the head once per step: activation-checkpoint recomputation comes after it."""
    parts = [plan.embedding, *(plan.block_path(i) for i in range(plan.num_blocks))]
    parts += [p for p in (plan.final_norm, plan.head) if p]
    state: dict[str, Any] = {"out": None, "from": None, "done": True}

    def record(path: str, _m: nn.Module, _args: tuple, out: Any) -> None:
        if cp.current is not None and not state["done"]:
            state["out"], state["from"] = out, path

    def check(path: str, previous: str, _m: nn.Module, args: tuple) -> None:
        if cp.current is None or state["done"]:
            return
        if not args or args[0] is not state["out"] or state["from"] != previous:
            state["done"] = True
            raise ContextParallelError(
                f"{type(module).__name__} has no forward, so the probe ran {plan.embedding} -> {plan.blocks} -> "
                f"{' -> '.join(parts[-2:] if plan.final_norm else parts[-1:])} itself and saw no position read; but "
                f"in this step {path} was not called on {previous}'s output (code between them that the probe "
                f"did not see may add positions). Give the LightningModule a forward(input_ids) that runs the "
                f"model, so the probe observes it, or use cp=1."
            )
        if path == parts[-1]:
            state["done"] = True

    def start(_m: nn.Module, _args: tuple, out: Any) -> None:
        if cp.current is not None:
            state.update(out=out, done=False)
            state["from"] = parts[0]

    cp.undo.append(module.get_submodule(parts[0]).register_forward_hook(start).remove)
    for previous, path in zip(parts, parts[1:]):
        sub = module.get_submodule(path)
        hook = functools.partial(check, path, previous)
        cp.undo.append(sub.register_forward_pre_hook(hook, prepend=True).remove)
        if path != parts[-1]:
            cp.undo.append(sub.register_forward_hook(functools.partial(record, path)).remove)


def _inject(cp: ContextState, where: str, index: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    shard = cp.current
    if shard is None:
        return None
    given = kwargs.get("position_ids", args[index] if index < len(args) else None)
    if given is not None:
        # Positions from the cut batch are this shard's; ones built inside the step from the
        # local length (arange, mask.cumsum) would silently restart at 0 on every rank.
        expected = shard.positions.to(given.device)
        if given.shape[-1] != expected.numel() or not bool((given == expected).all()):
            raise ContextParallelError(
                f"{where} got position_ids that are not this rank's global positions under cp={cp.size} (built from "
                f"the shard's length?). Pass none (the strategy supplies them) or the batch's own position_ids."
            )
        return None
    local = next((a.size(1) for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.dim() >= 2), None)
    if local is not None and local != shard.local_len:
        raise ContextParallelError(
            f"{where} was called on {local} tokens, but this rank's shard of the step's batch holds "
            f"{shard.local_len}; under cp={cp.size} the model must run on the batch the step received."
        )
    positions = shard.positions.unsqueeze(0)
    if index < len(args):
        return (*args[:index], positions, *args[index + 1 :]), kwargs
    return args, {**kwargs, "position_ids": positions}


def _slice_rotary(cp: ContextState, rotary: nn.Module) -> None:
    signature = inspect.signature(rotary.forward)

    def sharded(original: Any, *args: Any, **kwargs: Any) -> Any:
        shard = cp.current_shard
        bound = signature.bind(*args, **kwargs)
        bound.arguments["seq_len"] = shard.seq_len
        return _rows_at(original(*bound.args, **bound.kwargs), shard.positions, shard.seq_len)

    cp.wrap_forward(rotary, sharded)


def _rows_at(out: Any, positions: Tensor, seq_len: int) -> Any:
    """Select ``positions`` along the (last non-feature) dim of length ``seq_len`` of every tensor."""
    if isinstance(out, (tuple, list)):
        return type(out)(_rows_at(o, positions, seq_len) for o in out)
    if not isinstance(out, Tensor):
        return out
    dims = [d for d in range(out.dim() - 1) if out.size(d) == seq_len]
    if not dims:
        raise ContextParallelError(
            f"the rotary module returned shape {tuple(out.shape)} for seq_len={seq_len}; expected a dim of that length."
        )
    return out.index_select(dims[-1], positions.to(out.device))
