"""Give a meta-built, already parallelized model real tensors: each rank only its own pieces.

Step 4 of the design ("build on meta, apply the dimensions, then materialize"):

1. :func:`capture` (before any dimension cuts the model): every parameter and buffer name
   of the unsplit model -> its recorded storage (:mod:`record`). Tensors the recording
   never gave defined contents (a model put on meta outside our context, a parameter made
   with ``torch.empty`` and never filled) get one more chance: the module's own init
   methods run under the recorder (Hugging Face ``initialize_weights``, then the nearest
   ``init_weights()``, then ``reset_parameters()``); what is still undefined is a
   :class:`MaterializeError` naming the module and what it must provide.
2. :func:`materialize` (after the dimensions): meta tensors become empty tensors on the
   device (``_apply``, so FSDP2's DTensor shards are allocated at their local size), then
   the full value of each name this rank holds is recomputed (:mod:`replay`), one tensor
   at a time; the tp/ep/pp splits cut the rank's piece, and an FSDP2 DTensor's own
   placement its shard. Nothing is sent: every rank recomputes the same full tensor (in
   row chunks where :mod:`.chunks` can prove the chunks' values are the whole tensor's).

Peak memory: the rank's share plus one row chunk (``chunk_bytes``, 1 MiB) for tensors whose
recorded history is chunkable (:mod:`.chunks`: factories, ``uniform_`` / ``normal_`` and the
``nn.init`` functions built on them, element-wise fills and scales); plus one full tensor for any
other (``trunc_normal_``, ``orthogonal_``, a copy from another tensor).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_5d.materialize.chunks import fill_region
from lightning_5d.materialize.draws import CHUNK_BYTES
from lightning_5d.heap import release_freed_memory
from lightning_5d.materialize.record import InitLog, Ref, recording
from lightning_5d.materialize.replay import Replay
from lightning_5d.parallel.regions import dtensor_region, local_tensor, splits_region

_WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper (state dicts drop it)


class MaterializeError(RuntimeError):
    """A meta-built model part that cannot be given the values a single process would give it."""


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> list[Tensor]:
    return list(module.parameters()) + list(module.buffers())


def to_device_except_meta(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors that exist; meta ones wait for :func:`materialize`."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _named(module: nn.Module) -> dict[str, Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def capture(module: nn.Module, log: InitLog) -> dict[str, Ref]:
    """Name -> recorded ref for every meta tensor of the unsplit ``module`` (see the module docstring)."""
    refs, undefined = _refs(module, log)
    if undefined:
        _run_init_methods(module, log, undefined)
        refs, undefined = _refs(module, log)
    if undefined:
        raise MaterializeError(_undefined_report(module, undefined))
    return refs


def _refs(module: nn.Module, log: InitLog) -> tuple[dict[str, Ref], dict[str, str]]:
    replay = Replay(log)
    refs: dict[str, Ref] = {}
    undefined: dict[str, str] = {}
    for name, t in _named(module).items():
        if not t.is_meta:
            continue
        ref = log.ref(t)
        outside = "it was put on the meta device outside the strategy's init context"
        why = outside if ref is None else replay.defined(ref.key)
        if why is None:
            refs[name] = ref
        else:
            undefined[name] = why
    return refs, undefined


def _owner(module: nn.Module, name: str) -> tuple[str, nn.Module]:
    path = name.rpartition(".")[0]
    return path, module.get_submodule(path) if path else module


def _run_init_methods(module: nn.Module, log: InitLog, undefined: Mapping[str, str]) -> None:
    """The model's own init methods, recorded, for the modules owning undefined tensors."""
    owners = {path: m for path, m in (_owner(module, n) for n in undefined)}
    done: set[int] = set()
    with recording(log), torch.no_grad():
        for path, m in owners.items():
            parts = path.split(".") if path else []
            chain = [module.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]  # root .. owner
            hf = next((a for a in reversed(chain) if hasattr(a, "initialize_weights") and hasattr(a, "_init_weights")),
                      None)  # fmt: skip
            whole = next((a for a in reversed(chain) if callable(getattr(a, "init_weights", None))), None)
            if hf is not None:
                if id(hf) not in done:
                    done.add(id(hf))
                    hf.initialize_weights()
            elif whole is not None:
                if id(whole) not in done:
                    done.add(id(whole))
                    whole.init_weights()
            elif callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


def _undefined_report(module: nn.Module, undefined: Mapping[str, str]) -> str:
    lines = ["a model built on the meta device has tensors no rank can initialize as a single process would:"]
    for name, why in list(undefined.items())[:8]:
        path, owner = _owner(module, name)
        lines.append(f"  {name} (module '{path or '<root>'}', {type(owner).__name__}): {why}")
    if len(undefined) > 8:
        lines.append(f"  ... ({len(undefined)} in all)")
    _, first = _owner(module, next(iter(undefined)))
    cls = type(first).__name__
    lines.append(
        f"Initialize these tensors in {cls}.__init__ (e.g. nn.init.normal_(self.weight, std=0.02)), or give {cls} a "
        f"reset_parameters() that fills its own parameters and buffers (or the model an init_weights()); build the "
        f"model inside trainer.init_module() or configure_model so its construction is recorded; or build it eagerly "
        f"(trainer.init_module(empty_init=False))."
    )
    return "\n".join(lines)


def materialize(
    module: nn.Module,
    log: InitLog,
    refs: Mapping[str, Ref],
    device: torch.device,
    splits: Sequence[Any],
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[int, int]:
    """Allocate this rank's pieces on ``device`` and fill them; returns the number of names
    filled, and of those how many in row chunks.

    ``splits``: the tp / ep / pp objects (``local_state``: full tensors -> this rank's pieces,
    no communication). An FSDP2 shard is then cut from the piece where its DTensor says, so no
    rank sends anything: every rank recomputes the same full tensor. A tensor above
    ``chunk_bytes`` whose recorded history is chunkable (:mod:`.chunks`) is recomputed in row
    chunks of that size instead, keeping each chunk's part of the rank's region.
    """
    state = module.state_dict(keep_vars=True)
    persistent = [k for k, v in state.items() if isinstance(v, Tensor) and v.is_meta]
    buffers = [n for n, b in module.named_buffers() if b.is_meta and n.replace(_WRAPPED, "") not in state]
    # Only the names were needed: freed before _apply makes the rank's long-lived tensors, so its
    # many small objects do not sit between them in the interpreter's pools once freed.
    del state
    shared = _shared_parameters(module)
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    _retie(shared)
    missing = [k for k in persistent if k not in refs] + [n for n in buffers if n.replace(_WRAPPED, "") not in refs]
    if missing:
        raise MaterializeError(
            f"after the parallel dimensions were applied these meta tensors have no recorded initialization: "
            f"{', '.join(missing[:8])}. A dimension created them on the meta device; build the model eagerly "
            f"(trainer.init_module(empty_init=False)) for this layout."
        )
    targets = module.state_dict(keep_vars=True)
    live = dict(module.named_buffers())
    replay = Replay(log)
    pending = _Pending(log, [refs[n].key for n in persistent] + [refs[n.replace(_WRAPPED, "")].key for n in buffers])
    # The replay sets the generator before each draw; the user's stream is left as it was.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        chunked = 0
        for name in persistent:
            if _fill_in_chunks(name, targets[name], log, refs[name], replay, splits, chunk_bytes):
                chunked += 1
            else:
                piece = replay.value(refs[name])
                for split in splits:
                    piece = split.local_state({name: piece})[name]
                _fill(name, targets[name], piece)
                del piece
            pending.done(refs[name].key)
        for name in buffers:
            _fill(name, live[name], replay.value(refs[name.replace(_WRAPPED, "")]))
            pending.done(refs[name.replace(_WRAPPED, "")].key)
    release_freed_memory()
    return len(persistent) + len(buffers), chunked


class _Pending:
    """The recorded calls still needed by the tensors not yet materialized; the others are dropped
    from the log as the replay goes (most of the log is one generator state per draw, ~5 KB each:
    1.2 MiB for a 0.5 B Llama), so the log does not sit on top of the rank's filled share at the
    replay's peak. Freed pages (and a whole tensor's, where one was recomputed) go back to the OS."""

    def __init__(self, log: InitLog, keys: list[int]) -> None:
        self.log = log
        self.inputs = {key: log.inputs(key) for key in set(keys)}
        self.users: dict[int, int] = {}
        for key in keys:  # once per name: tied names share a storage
            for needed in self.inputs[key]:
                self.users[needed] = self.users.get(needed, 0) + 1

    def done(self, key: int) -> None:
        finished = set()
        for needed in self.inputs[key]:
            self.users[needed] -= 1
            if self.users[needed] == 0:
                finished.add(needed)
        self.log.drop(finished)
        release_freed_memory()


def _fill_in_chunks(
    name: str, target: Tensor, log: InitLog, ref: Ref, replay: Replay, splits: Sequence[Any], chunk_bytes: int
) -> bool:
    """Fill ``target`` with its region of the recorded value one row chunk at a time, if the
    tensor is big enough to matter and its history is chunkable; False: the caller recomputes it whole."""
    full = math.prod(ref.size) * ref.dtype.itemsize
    if full <= chunk_bytes or not all(hasattr(s, "local_region") for s in splits):
        return False
    start = replay.start(ref.key)
    if start is None:
        return False
    region = dtensor_region(splits_region(name, ref.size, splits), target)
    local = local_tensor(target)
    if tuple(local.shape) != region.local_shape or local.dtype != ref.dtype:
        return False  # a cut the regions do not describe: the whole tensor's path reports it
    # The chunks are computed on CPU (the kernels whose draw order the values follow) and
    # copied into the rank's tensor, on its device, piece by piece.
    return fill_region(log, ref, start, region, local, chunk_bytes)


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place (tied weights)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for key, param in owner._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((owner, key))
    return [group for group in places.values() if len(group) > 1]


def _retie(shared: list[list[tuple[nn.Module, str]]]) -> None:
    """``Module._apply`` replaces a meta parameter in each module that holds it, one new tensor per
    place, so tied weights (an embedding shared with the head) would train as two; point every
    place back at one."""
    for (first, first_key), *others in shared:
        param = first._parameters[first_key]
        for owner, key in others:
            owner._parameters[key] = param


def _fill(name: str, target: Tensor, piece: Tensor) -> None:
    """Copy this rank's part of ``piece`` (the tensor at its tp/ep-local shape) into ``target``."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(piece.shape, target.device_mesh, target.placements)
        piece = piece[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        target = target._local_tensor
    if tuple(target.shape) != tuple(piece.shape):
        raise MaterializeError(
            f"{name}: this rank holds shape {list(target.shape)}, its recorded initialization cuts to "
            f"{list(piece.shape)}; a dimension changed the tensor in a way materialization does not follow. Build "
            f"the model eagerly (trainer.init_module(empty_init=False)) for this layout."
        )
    target.copy_(piece)


def placement_device(module: nn.Module, device_type: str) -> torch.device:
    """Where a dimension should create its own tensors: the model's device, or for a model
    still on the meta device the device it will be materialized on (this rank's)."""
    p = next(module.parameters(), None)
    if p is not None and not p.is_meta:
        return p.device
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)
