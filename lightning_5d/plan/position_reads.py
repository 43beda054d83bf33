"""Where a model that takes no position input reads its token positions, observed on a probe.

Context parallelism runs the model on a shard of the sequence. A model that numbers its
tokens 0..n−1 itself would then number every shard from 0; it must read each token's
*global* position instead. For a model without a ``position_ids`` argument this module
finds where the positions enter, in ways the shard's positions can be put into:

* :attr:`PositionReadKind.ARANGE_EMBEDDING`: an ``nn.Embedding`` other than the token
  embedding called on ``torch.arange(n)`` (nanoGPT's ``wpe(arange(t))``); its input becomes
  the given positions.
* :attr:`PositionReadKind.TABLE_SLICE`: a tensor the model holds (a learned
  ``nn.Parameter``, a sinusoidal buffer) read as its first n rows along one dim
  (``pe[:n]``, ``pos[:, :n]``); the read returns the rows at the given positions instead.
* :attr:`PositionReadKind.ARANGE`: ``torch.arange(n)`` built inside a module's forward and
  used otherwise (rotary angles inside each attention, or once at the top of the model); at
  its call sites (:mod:`lightning_5d.plan.position_aranges`) it becomes the given positions.
* none at all (NoPE: the causal mask alone orders the tokens).

Observation has two steps, and a model passes only if both do (otherwise it is "not
observed" and context parallelism refuses it with what to add):

1. **Watch** (two probe lengths, so that a read is seen to follow the length): every
   ``torch.arange`` call site must give the probe's positions (``arange(n)``, possibly shifted
   by a past length) on both probes, or the same length on both (frequencies, head indices:
   no positions); one whose outputs all feed a position embedding is that embedding's read.
   Every tensor the model holds outside its layers' parameters must be indexed only as a
   leading slice of the sequence length along one dim (used whole, as rotary frequencies are,
   it carries no position).
2. **Prove token-wise**: with every ``F.scaled_dot_product_attention`` call replaced by a
   token-local stand-in (each token's ``v + q + k``: no token sees another), the model on a
   subset of the positions, with the reads redirected to those positions, must give the
   rows of those positions of its run on the whole sequence. Anything else that carries a
   position (a ``linspace`` table, a length-dependent scale, an ``arange`` redirected at the
   wrong place) or mixes tokens outside attention makes the rows differ. Each arange site
   must also be needed: a site the proof passes without feeds only attention's mask or bias
   (ALiBi distances, a causal mask), which the stand-in ignores, and the model is not observed.

With those reads redirected, a shard's tokens then compute what they compute in the whole
sequence, except inside attention, which ring attention makes global.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.config import LayoutError
from lightning_5d.plan.arange_flow import ArangeFlow
from lightning_5d.forward_patch import replace_forward
from lightning_5d.plan import position_aranges
from lightning_5d.plan.position_aranges import ArangeSite

PROBE_LENGTHS = (8, 12)  # two lengths: a read that follows the sequence length is seen to
# Zig-zag-like shards of 12 positions, and a contiguous one: the zig-zag pair is symmetric
# (reversing a shard's positions gives 11 - each), so only the latter shows a reversed range.
SUBSETS = ((0, 1, 2, 9, 10, 11), (3, 4, 5, 6, 7, 8), (6, 7, 8, 9, 10, 11))
_RTOL = 1e-4  # the same float32 computation on fewer rows; only blocking order may differ


class PositionReadKind(Enum):
    ARANGE_EMBEDDING = "arange_embedding"
    TABLE_SLICE = "table_slice"
    ARANGE = "arange"


@dataclass(frozen=True)
class PositionRead:
    """One place the forward reads token positions. ``path``: the embedding (ARANGE_EMBEDDING)
    or the module holding the table (TABLE_SLICE) or whose forward calls ``sites`` (ARANGE);
    ``name``/``dim``: the table's attribute and the dim its rows are positions along."""

    kind: PositionReadKind
    path: str
    name: str = ""
    dim: int = 0
    sites: tuple[ArangeSite, ...] = ()

    def describe(self) -> str:
        if self.kind is PositionReadKind.ARANGE_EMBEDDING:
            return f"{self.path or 'the model'} (an embedding of arange(n))"
        if self.kind is PositionReadKind.ARANGE:
            return f"{self.path or 'the model'} ({', '.join(s.describe() for s in self.sites)})"
        return f"{self.path + '.' if self.path else ''}{self.name} (rows [:n] along dim {self.dim})"


class PositionReadError(LayoutError):
    """A redirected read met something the probe did not show (the message says what)."""


def takes_position_ids(fn: Any) -> bool:
    try:
        return "position_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------ redirecting (probe and cp)


Positions = Callable[[], "Tensor | None"]  # this call's global positions [n], or None: leave alone
# wrap(module, sharded): module.forward(*a, **k) runs sharded(original_forward, *a, **k); returns its undo or None
Wrap = Callable[[nn.Module, Callable[..., Any]], "Callable[[], None] | None"]


def redirect_reads(
    root: nn.Module, reads: tuple[PositionRead, ...], positions: Positions, wrap: Wrap
) -> list[Callable[[], None]]:
    """Make each read see ``positions()`` while it returns a tensor; returns what undoes the hooks.

    ``wrap``: how a module's forward is wrapped (context parallelism's, so that it acts only
    while a shard is current; the probe's own otherwise).
    """
    undo: list[Callable[[], None]] = []
    for read in reads:
        if read.kind is PositionReadKind.ARANGE_EMBEDDING:
            hook = _embedding_hook(read, positions)
            undo.append(root.get_submodule(read.path).register_forward_pre_hook(hook).remove)
        elif read.kind is PositionReadKind.ARANGE:
            keys = frozenset(site.key for site in read.sites)
            sharded = position_aranges.sites_forward(keys, positions, read.path or "the model")
            undone = wrap(root.get_submodule(read.path), sharded)
            if undone is not None:
                undo.append(undone)
        else:
            owner = root.get_submodule(read.path)
            undone = wrap(owner, _table_forward(owner, read, positions))
            if undone is not None:
                undo.append(undone)
    return undo


_WAY_OUT = (
    ". Take a position_ids argument in the model's forward and build the position embedding from it (the "
    "strategy then hands in each shard's global positions), or use cp=1."
)


def _embedding_hook(read: PositionRead, positions: Positions) -> Callable:
    def hook(_module: nn.Module, args: tuple) -> Any:
        given = positions()
        if given is None or not args or not isinstance(args[0], Tensor):
            return None
        ids = args[0]
        n = given.numel()
        local = torch.arange(n, device=ids.device)
        if ids.shape[-1] == n and bool((ids == given.to(ids.device)).all()):
            return None  # already the global positions (handed in from outside)
        if ids.shape[-1] != n or not bool((ids == local).all()):
            raise PositionReadError(
                f"{read.path} was observed to embed arange(n) of the sequence length, but got {tuple(ids.shape)} "
                f"indices that are not arange({n}){_WAY_OUT}"
            )
        return (given.to(ids.device).expand(ids.shape), *args[1:])

    return hook


def _table_forward(owner: nn.Module, read: PositionRead, positions: Positions) -> Callable[..., Any]:
    return position_aranges.redirected_forward(positions, lambda given: _RowsAt(owner, read, given))


class _RowsAt(TorchFunctionMode):
    """``table[..., :n]`` of the observed table becomes its rows at ``positions`` (same shape)."""

    def __init__(self, owner: nn.Module, read: PositionRead, positions: Tensor) -> None:
        super().__init__()
        self.owner, self.read, self.positions = owner, read, positions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and args and args[0] is getattr(self.owner, self.read.name, None):
            n = _leading_slice(args[1], self.read.dim)
            if n != self.positions.numel():
                raise PositionReadError(
                    f"{self.read.describe()} was read as {args[1]!r}, not as the first {self.positions.numel()} rows "
                    f"the probe saw{_WAY_OUT}"
                )
            table = args[0]
            return table.index_select(self.read.dim, self.positions.to(table.device))
        return func(*args, **kwargs)


def _leading_slice(index: Any, dim: int) -> int | None:
    """n when ``index`` is ``[:, ..., :n]`` with the ``:n`` at ``dim`` (nothing after), else None."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) != dim + 1 or not all(isinstance(p, slice) and p == slice(None) for p in parts[:dim]):
        return None
    last = parts[dim]
    if not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1):
        return None
    stop = last.stop
    if isinstance(stop, Tensor) and stop.numel() == 1:
        stop = int(stop)
    return stop if isinstance(stop, int) else None


# ------------------------------------------------------------------ observing


Runner = Callable[[Tensor], "Tensor | None"]  # the model's output (first float tensor) on ids [1, n]


def observe_reads(root: nn.Module, token_embedding: str, run: Runner) -> tuple[PositionRead, ...] | None:
    """The reads (possibly none: NoPE) when both steps pass, else None (not observed)."""
    try:
        reads = _watch(root, token_embedding, run)
        if reads is None or not _tokenwise(root, reads, run):
            return None
        if any(_tokenwise(root, without, run) for without in _each_site_left_out(reads)):
            return None
    except Exception:  # noqa: BLE001 - a model the probe cannot run or redirect is simply not observed
        return None
    return reads


def _each_site_left_out(reads: tuple[PositionRead, ...]) -> list[tuple[PositionRead, ...]]:
    """``reads`` without one arange site (in every scope), for each site. A site the token-wise
    proof passes without reaches no token's value: it feeds only the attention's mask or bias
    (ALiBi distances, a causal mask from arange), which is attention's business, or nothing;
    such a model stays "not observed" rather than read as carrying its positions there."""
    keys = dict.fromkeys(site.key for read in reads for site in read.sites)
    variants = []
    for key in keys:
        kept = []
        for read in reads:
            sites = tuple(site for site in read.sites if site.key != key)
            if read.kind is not PositionReadKind.ARANGE or sites:
                kept.append(replace(read, sites=sites))
        variants.append(tuple(kept))
    return variants


def _held_tables(root: nn.Module) -> dict[int, tuple[str, str, bool]]:
    """id -> (owner path, attribute, is a parameter) of every tensor the model holds outside its
    layers' weights: buffers, plain tensor attributes, and parameters of modules that have children
    (a learned table on the model; layers such as Linear or a norm hold theirs without children)."""
    found: dict[int, tuple[str, str, bool]] = {}
    for path, module in root.named_modules():
        held = {k: (v, False) for k, v in module.named_buffers(recurse=False)}
        held.update((k, (v, False)) for k, v in vars(module).items() if isinstance(v, Tensor))
        if any(True for _ in module.children()):
            held.update((k, (v, True)) for k, v in module.named_parameters(recurse=False))
        for name, (tensor, parameter) in held.items():
            if tensor is not None:
                found.setdefault(id(tensor), (path, name, parameter))
    return found


class _Watch(TorchFunctionMode):
    """Records arange outputs and the uses of the held tables: leading slices of a length, and
    any other use of a buffer (a parameter used otherwise is a weight, e.g. nn.MultiheadAttention's
    in_proj_weight; a table read in a way not seen here fails the token-wise proof)."""

    def __init__(self, tables: dict[int, tuple[str, str, bool]], modules: dict[int, str]) -> None:
        super().__init__()
        self.tables, self.modules = tables, modules
        self.aranges: list[Tensor] = []
        self.arange_calls: list[tuple[ArangeSite, str | None]] = []  # per arange: its site and scope
        self.slices: dict[int, set[tuple[int, int]]] = {}  # table id -> {(dim, n)}
        self.other_use: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.arange:
            self.aranges.append(out)
            frame = position_aranges.caller_frame()
            site = position_aranges.site_of(frame) if frame is not None else None
            self.arange_calls.append((site, position_aranges.scope_of(frame, self.modules)))
            return out
        if func is Tensor.__getitem__ and args and id(args[0]) in self.tables:
            found = next(((d, n) for d in range(args[0].dim()) if (n := _leading_slice(args[1], d)) is not None), None)
            if found is not None:
                self.slices.setdefault(id(args[0]), set()).add(found)
            elif isinstance(args[1], Tensor) and any(_same_storage(args[1], a) for a in self.aranges):
                pass  # rows at an arange's values (cos_cached[position_ids]): the arange's site is the read
            elif not self.tables[id(args[0])][2]:
                self.other_use.add(id(args[0]))
            return out
        if args and out is args[0] and id(out) in self.tables:
            return out  # the table itself back (``pe.to(device)`` already there): no read of its rows
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor) and id(value) in self.tables and not self.tables[id(value)][2]:
                # A buffer too short to hold a row per probe position (rotary inv_freq) used whole
                # carries no position; a longer one used whole could be a table read another way.
                if not _metadata(func) and max(value.shape, default=0) >= max(PROBE_LENGTHS):
                    self.other_use.add(id(value))
        return out


# Reads of a table's metadata, not its values: a length check (``pe.size(0)``) is no use of the rows.
_METADATA = (
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.is_floating_point, Tensor.__len__,
    Tensor.shape.__get__, Tensor.ndim.__get__, Tensor.dtype.__get__, Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__get__, Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
)


def _metadata(func: Any) -> bool:
    return any(func == m for m in _METADATA)


def _watch(root: nn.Module, token_embedding: str, run: Runner) -> tuple[PositionRead, ...] | None:
    tables = _held_tables(root)
    embeddings = {
        path: m for path, m in root.named_modules() if isinstance(m, nn.Embedding) and path != token_embedding
    }
    seen: dict[str, list[tuple[int, bool]]] = {}  # embedding -> [(length, fed an arange of it)]
    table_reads: dict[int, list[set[int]]] = {}  # table id -> per probe, the dims sliced to its length
    modules = position_aranges.module_paths(root)
    sites: dict[ArangeSite | None, dict[int, list[_ArangeCall]]] = {}  # site -> probe length -> its calls
    for n in PROBE_LENGTHS:
        watch, flow = _Watch(tables, modules), ArangeFlow()
        fed: list[Tensor] = []
        handles = [m.register_forward_pre_hook(_record_input(path, n, watch, seen, fed))
                   for path, m in embeddings.items()]  # fmt: skip
        try:
            with watch, flow, torch.no_grad():
                out = run(torch.zeros(1, n, dtype=torch.long))
        finally:
            for h in handles:
                h.remove()
        if out is None or watch.other_use:
            return None
        # An arange that reaches the output only through a proven ALiBi attn_mask (which ring
        # attention rebuilds from global positions) or not at all carries no position to redirect.
        reaching = {id(flow.aranges[i]) for i in flow.labels(out)}
        for made, (site, scope) in zip(watch.aranges, watch.arange_calls):
            if id(made) not in reaching:
                continue
            call = _ArangeCall(scope, made.numel(), position_aranges.is_range_of(made, n),
                               any(_same_storage(made, f) for f in fed))  # fmt: skip
            sites.setdefault(site, {}).setdefault(n, []).append(call)
        for key, reads in watch.slices.items():
            if any(length != n for _, length in reads) and not tables[key][2]:
                return None  # a buffer read at another length than the sequence's
            table_reads.setdefault(key, []).append({d for d, length in reads if length == n})
    arange_reads = _arange_reads(sites)
    if arange_reads is None:
        return None
    reads: list[PositionRead] = list(arange_reads)
    for path, calls in seen.items():
        fed_flags = [f for _, f in calls]
        if all(fed_flags) and {n for n, _ in calls} == set(PROBE_LENGTHS):
            reads.append(PositionRead(PositionReadKind.ARANGE_EMBEDDING, path))
        elif any(fed_flags):
            return None  # fed an arange on one probe only, or also called on something else
    for key, per_probe in table_reads.items():
        path, name, parameter = tables[key]
        dims = set.union(*per_probe)
        if len(per_probe) == len(PROBE_LENGTHS) and len(dims) == 1 and all(per_probe):
            reads.append(PositionRead(PositionReadKind.TABLE_SLICE, path, name, next(iter(dims))))
        elif not parameter or any(per_probe):
            return None  # read at the sequence length on one probe only, or along two dims
    return tuple(reads)


@dataclass(frozen=True)
class _ArangeCall:
    scope: str | None  # the innermost module whose forward made it
    length: int
    is_range: bool  # start..start+n-1 for the probe's length n
    fed: bool  # the input of a position embedding


def _arange_reads(sites: dict[ArangeSite | None, dict[int, list[_ArangeCall]]]) -> list[PositionRead] | None:
    """One ARANGE read per scope that makes the probe's positions; None when a site follows the
    length otherwise (or was made where no module's forward was running)."""
    by_scope: dict[str, list[ArangeSite]] = {}
    for site, per_probe in sites.items():
        calls = [c for cs in per_probe.values() for c in cs]
        if all(c.fed for c in calls):
            continue  # a position embedding's input: that embedding's read
        if len({c.length for c in calls}) == 1 and len(per_probe) == len(PROBE_LENGTHS):
            continue  # the same length on both probes: no position in it (frequencies, head indices)
        scopes = [{c.scope for c in per_probe.get(n, ())} for n in PROBE_LENGTHS]
        ranges = all(c.is_range for c in calls) and scopes[0] == scopes[-1] and None not in scopes[0]
        if site is None or not ranges:
            return None  # arange(2n), arange(0, n, 2), a site on one probe only, ...
        for scope in sorted(scopes[0]):
            by_scope.setdefault(scope, []).append(site)
    return [PositionRead(PositionReadKind.ARANGE, scope, sites=tuple(found)) for scope, found in by_scope.items()]


def _record_input(path: str, n: int, watch: _Watch, seen: dict, fed: list[Tensor]) -> Callable:
    expected = torch.arange(n)  # built here, outside the watch: the hook runs inside it
    def hook(_module: nn.Module, args: tuple) -> None:
        ids = args[0] if args and isinstance(args[0], Tensor) else None
        is_arange = (
            ids is not None
            and ids.shape[-1] == n
            and any(_same_storage(ids, a) for a in watch.aranges)
            and bool((ids == expected.to(ids.device)).all())
        )
        if is_arange:
            fed.append(ids)
        seen.setdefault(path, []).append((n, is_arange))

    return hook


def _same_storage(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are the same tensor or views of one (``pos[None]``, ``pos.unsqueeze(0)``)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return a is b


class _TokenLocalAttention(TorchFunctionMode):
    """Each query's output from its own token only: ``v + q + k`` (key/value heads repeated to the
    query heads), so that positions applied to q or k (rotary) still reach the output."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value")
        q, k, v = (kwargs[nm] if nm in kwargs else args[i] for i, nm in enumerate(names))
        groups = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        return v + q + k if q.shape == v.shape == k.shape else v


def _tokenwise(root: nn.Module, reads: tuple[PositionRead, ...], run: Runner) -> bool:
    length = max(PROBE_LENGTHS)
    ids = torch.randint(0, 2, (1, length), generator=torch.Generator().manual_seed(3))
    ids = ids + torch.arange(length) % 5  # distinct-ish tokens, all below any vocabulary size
    current: list[Tensor | None] = [None]
    undo = redirect_reads(root, reads, lambda: current[0], _local_wrap)
    try:
        with _TokenLocalAttention(), torch.no_grad():
            whole = run(ids)
            if whole is None:
                return False
            for subset in SUBSETS:
                current[0] = torch.tensor(subset)
                part = run(ids[:, list(subset)])
                current[0] = None
                expected = whole[:, list(subset)]
                if part is None or part.shape != expected.shape:
                    return False
                scale = expected.abs().max().clamp_min(1e-12)
                if float((part - expected).abs().max() / scale) > _RTOL:
                    return False
    finally:
        for u in reversed(undo):
            u()
    return True


def _local_wrap(module: nn.Module, sharded: Callable[..., Any]) -> Callable[[], None]:
    original = module.forward
    return replace_forward(module, lambda *args, **kwargs: sharded(original, *args, **kwargs))
