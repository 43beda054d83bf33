"""Record how a model built on the meta device would have been initialized.

Building under :class:`InitRecorder` (a ``TorchFunctionMode`` entered inside
``torch.device("meta")``) costs no parameter memory: every tensor is a meta tensor. The
recorder writes down each torch call that creates or writes a meta tensor (factories,
``nn.init.*``, in-place fills, out-of-place math that builds buffers such as rotary
tables), keyed by *storage*, so ``.data``, views, ``nn.Parameter(t)`` and tied weights
all resolve to the one storage they share.

For a random call it also does what an eager build does to the generator: it draws the
same numbers into a throw-away CPU tensor of the same shape, and stores the generator
state from just before the draw. So (a) the global RNG leaves the build in the state an
eager build leaves it in (``fork_rng`` / ``manual_seed`` inside the user's ``__init__``
behave as they would), and (b) :mod:`lightning_5d.materialize.replay` can recompute any
one tensor later, on its own, with the exact values of a single-process eager build on
CPU: it restores each draw's recorded state. Memory while recording: one chunk (1 MiB) where
the call's one draw is a whole-tensor ``uniform_`` / ``normal_`` (:mod:`.draws`: the
``nn.init`` functions, ``nn.Linear`` / ``nn.Embedding``, Hugging Face's ``normal_``); otherwise
one tensor's scratch, mapped from the OS for the draw and unmapped after it
(:func:`lightning_5d.heap.scratch_storage`).
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_5d.heap import MappedCopies, release_freed_memory, scratch_storage
from lightning_5d.materialize.draws import advance, observe
from lightning_5d.materialize.trees import leaves, map_leaves

# Calls whose result depends on the generator (matched by name; nn.init's own are listed
# separately because some of them are deterministic).
_RANDOM_NAMES = frozenset(
    {
        "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
        "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
        "rand_like", "randn_like", "randint_like", "dropout",
    }
)  # fmt: skip
_DETERMINISTIC_INIT = frozenset({"constant_", "ones_", "zeros_", "eye_", "dirac_"})
# In-place calls that leave no trace of the tensor's previous contents when they cover all of it.
_OVERWRITES = frozenset({"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_",
                         "log_normal_", "cauchy_", "fill_", "zero_", "copy_"})  # fmt: skip
# Creations whose contents are undefined: a tensor whose last overwrite is one of these was never initialized.
EMPTY_CREATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def func_name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


def _is_init_fn(func: Callable) -> bool:
    return getattr(func, "__module__", None) == "torch.nn.init"


def is_random(func: Callable) -> bool:
    name = func_name(func)
    if _is_init_fn(func):
        return name.endswith("_") and name not in _DETERMINISTIC_INIT
    return name in _RANDOM_NAMES


def _is_meta(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_meta


@dataclass(frozen=True, slots=True)
class Ref:
    """A meta tensor as (recorded storage, view geometry): enough to rebuild it on a real storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def covers(self, nbytes: int) -> bool:
        """Whether the view is the whole storage, contiguously (an overwrite of it then erases it)."""
        numel = 1
        for s in self.size:
            numel *= s
        contiguous, expected = True, 1
        for s, st in zip(reversed(self.size), reversed(self.stride)):
            if s != 1 and st != expected:
                contiguous = False
            expected *= s
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == nbytes


@dataclass(slots=True)
class Op:
    """One recorded call; tensors in ``args`` / ``kwargs`` are :class:`Ref` (meta) or kept as constants."""

    index: int
    func: Callable
    args: tuple
    kwargs: dict
    outs: tuple[Ref | None, ...]  # the flattened result's meta tensors (None for anything else)
    # Storage keys as tuples, not sets (a set of one key is 216 bytes, a tuple 48): the log holds one
    # call per draw and fill (409 for the 0.5 B reference model), and the pools its small objects
    # took stay resident after it is freed (benchmarks/RESULTS.md "gap2").
    creates: tuple[int, ...]  # storages first seen in the result
    writes: tuple[int, ...]  # storages changed in place
    overwrites: tuple[int, ...]  # storages changed in place over their whole extent
    factory: bool  # no tensor argument: replayed with device= set
    rng: Tensor | None = None  # CPU generator state just before a random call
    generators: dict[int, Tensor] | None = None  # explicit generator= : its state (None: no explicit one)

    @property
    def name(self) -> str:
        return func_name(self.func)


class InitLog:
    """Storages seen while recording (kept alive so their ids stay unique) and the calls, in order."""

    def __init__(self) -> None:
        self.ops: list[Op | None] = []  # None: dropped once every tensor that needs it is materialized
        self.nbytes: dict[int, int] = {}
        self._keys: dict[int, int] = {}
        self._alive: list[Any] = []
        self.history: dict[int, list[int]] = {}  # storage key -> indices of ops that create or write it
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct size / stride
        self._refs: dict[Ref, Ref] = {}  # one Ref per distinct view (calls name the same tensor many times)
        # The generator states of the random calls, off the C heap (see MappedCopies for why).
        self.states = MappedCopies()

    def key_of(self, t: Tensor) -> int | None:
        return self._keys.get(t.untyped_storage()._cdata)

    def ref(self, t: Tensor, register: bool = False) -> Ref | None:
        storage = t.untyped_storage()
        key = self._keys.get(storage._cdata)
        if key is None:
            if not register:
                return None
            key = len(self.nbytes)
            self._keys[storage._cdata] = key
            self.nbytes[key] = storage.nbytes()
            self._alive.append(storage)
        ref = Ref(key, self.shape(tuple(t.shape)), self.shape(t.stride()), t.storage_offset(), t.dtype)
        return self._refs.setdefault(ref, ref)

    def shape(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        """``dims``, as the one tuple of these values the log keeps (every block records the same shapes)."""
        return self._shapes.setdefault(dims, dims)

    def add(self, op: Op) -> None:
        self.ops.append(op)
        for key in dict.fromkeys(op.creates + op.writes):
            self.history.setdefault(key, []).append(op.index)

    def inputs(self, key: int) -> set[int]:
        """The storages ``key``'s recorded value is computed from: itself and, transitively, every
        storage a call in its history reads."""
        seen, todo = {key}, [key]
        while todo:
            for index in self.history.get(todo.pop(), []):
                op = self.ops[index]
                if op is None:
                    continue
                flat = leaves((op.args, op.kwargs))
                for r in flat:
                    if isinstance(r, Ref) and r.key not in seen:
                        seen.add(r.key)
                        todo.append(r.key)
        return seen

    def drop(self, keys: set[int]) -> None:
        """Forget the calls that create or write only ``keys`` (their generator states are most of
        the log's memory). A later replay of a storage that needs them fails loudly: its history
        is gone (:class:`~.replay.Uninitialized`), it is not silently recomputed without its draws."""
        for key in keys:
            for index in self.history.pop(key, []):
                op = self.ops[index]
                if op is not None and not any(k in self.history for k in op.creates + op.writes):
                    self.ops[index] = None


class InitRecorder(TorchFunctionMode):
    """Enter inside ``torch.device("meta")``; see the module docstring."""

    def __init__(self, log: InitLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in = leaves((args, kwargs))
        tensors_in = [x for x in flat_in if isinstance(x, Tensor)]
        rng, generators = None, None
        factory = not tensors_in
        # Only a draw that lands on the meta device is skipped by torch: a real (CPU) one draws itself.
        lands_on_meta = any(_is_meta(x) for x in tensors_in) or (factory and _meta_device(kwargs.get("device")))
        random = is_random(func) and lands_on_meta
        if random:
            states = self.log.states
            rng = states.copy(torch.get_rng_state())
            generators = {id(g): states.copy(g.get_state()) for g in flat_in if isinstance(g, torch.Generator)} or None
            draw = observe(func, args, kwargs)
        out = func(*args, **kwargs)
        on_meta = any(_is_meta(x) for x in tensors_in) or _has_meta(out)
        if random and on_meta:
            # torch skipped the draw on meta: move the generator on as the eager build's draw does.
            # (Seen, not assumed: a factory that is not one of torch.device's, e.g. torch.normal(0., 1.,
            # size), lands on CPU under the meta context and has drawn for real already.)
            if draw is not None:
                advance(draw)  # one chunk at a time
            else:
                self._draw_on_scratch(func, args, kwargs, factory=factory)
        if not on_meta:
            return out  # nothing on the meta device: not part of the model's construction
        self._record(func, args, kwargs, out, rng, generators, factory=factory)
        return out

    def _draw_on_scratch(self, func, args, kwargs, factory: bool) -> None:
        """Advance the generator exactly as an eager CPU build would (the numbers are discarded)."""

        def scratch(x: Any) -> Any:
            if not _is_meta(x):
                return x
            view = torch.empty(0, dtype=x.dtype, device="cpu")
            return view.set_(scratch_storage(x.untyped_storage().nbytes()), x.storage_offset(), x.shape, x.stride())

        with torch.no_grad():
            if factory:
                func(*args, **{**kwargs, "device": torch.device("cpu")})
                # A factory's draw comes from the heap: glibc keeps such freed pages and, with tensors
                # of many sizes, rarely reuses them (the build's RSS would grow towards the whole model).
                release_freed_memory()
            else:
                func(*map_leaves(scratch, args), **map_leaves(scratch, kwargs))

    def _record(self, func, args, kwargs, out, rng, generators, factory: bool) -> None:
        log = self.log

        def to_ref(x: Any) -> Any:
            if _is_meta(x):
                return log.ref(x, register=True)
            return x

        # An input seen for the first time (a meta model built outside the recording) exists already:
        # it is not created by this call, whose write must then be a full one to give it contents.
        rargs, rkwargs = map_leaves(to_ref, args), map_leaves(to_ref, kwargs)
        known = set(log.nbytes)
        flat_out = leaves(out)
        outs = tuple(log.ref(x, register=True) if _is_meta(x) else None for x in flat_out)
        creates = tuple(dict.fromkeys(r.key for r in outs if r is not None and r.key not in known))
        target = _written(func, rargs, rkwargs)
        writes = tuple(dict.fromkeys(r.key for r in target))
        name = func_name(func)
        full = _is_init_fn(func) or name in _OVERWRITES
        overwrites = tuple(dict.fromkeys(r.key for r in target if full and r.covers(log.nbytes[r.key])))
        if overwrites == writes:
            overwrites = writes  # the usual full fill: one set for both
        if not creates and not writes:
            return  # a view or a read: the storage it touches is recorded where it was made
        log.add(Op(len(log.ops), func, rargs, rkwargs, outs, creates, writes, overwrites, factory, rng, generators))


def _written(func, args: tuple, kwargs: dict) -> list[Ref]:
    """The refs a call changes in place: ``x.op_(...)``, ``nn.init.*_(x)``, ``x[...] = v``, ``out=``."""
    name = func_name(func)
    refs = []
    inplace = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
    # nn.init's functions hand the tensor on as ``tensor=`` when they dispatch to a mode.
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if inplace and isinstance(first, Ref):
        refs.append(first)
    out = kwargs.get("out")
    flat = leaves(out)
    refs.extend(r for r in flat if isinstance(r, Ref))
    return refs


def _meta_device(device: Any) -> bool:
    """A factory's ``device=``: unset means the enclosing ``torch.device("meta")``."""
    return device is None or torch.device(device).type == "meta"


def _has_meta(out: Any) -> bool:
    flat = leaves(out)
    return any(_is_meta(x) for x in flat)


# torch.nn.init functions that return early on a meta tensor without dispatching to a mode
# (so neither their draws nor their writes would be seen); wrapped while recording.
_SILENT_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextmanager
def recording(log: InitLog) -> Iterator[None]:
    """Build on the meta device and record the initialization into ``log``.

    Two scoped patches, undone on exit, because the code they cover never reaches a torch
    function mode on meta tensors: the ``nn.init`` functions above, and Hugging Face's
    ``init_weights``, which skips ``_init_weights`` entirely when it sees a meta default
    device (its recorded calls are what gives a meta-built HF model its eager values).
    """
    recorder = InitRecorder(log)
    patches: list[tuple[Any, str, Any]] = []

    def wrap(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if _is_meta(tensor):
                return recorder.__torch_function__(orig, (), (tensor, *args), kwargs)
            return orig(tensor, *args, **kwargs)

        return wrapper

    for name in _SILENT_ON_META:
        patches.append((nn.init, name, wrap(getattr(nn.init, name))))
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and hasattr(hf, "get_torch_context_manager_or_global_device"):
        patches.append((hf, "get_torch_context_manager_or_global_device", lambda: torch.device("cpu")))
    hf_init = sys.modules.get("transformers.initialization")
    table = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None) if hf_init is not None else None
    saved_table = dict(table) if isinstance(table, dict) else None
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        if saved_table is not None:
            for name in _SILENT_ON_META:
                if name in table:
                    table[name] = wrap(saved_table[name])
        with torch.device("meta"), recorder:
            yield
    finally:
        log.states.close()  # a later recording into this log starts a mapping of its own
        release_freed_memory()  # the draws' scratch tensors
        for owner, name, old in originals:
            setattr(owner, name, old)
        if saved_table is not None:
            table.update(saved_table)
