"""Load a plain or Hugging Face state dict into an already parallelized model, key by key.

Sources: a ``.safetensors`` file, a ``.pt`` / ``.bin`` / full ``.ckpt`` file (read with
``torch.load(weights_only=True)``, memory-mapped where the file allows it), or a Hugging
Face folder (``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``
or its index). Each rank reads only the entries its own module holds after pipeline and
expert parallelism, and of each only the slice it holds after tensor parallelism, grouped
experts and its FSDP2 shard (``lightning_5d.parallel.regions``), one tensor at a time,
straight into its parameter. No rank reads or holds the whole model, nor sends anything.

safetensors files are sliced lazily: a slice that is one run of the file's bytes in the
parameter's dtype is read straight into the parameter (:meth:`StateSource.read_into`), any
other through ``safe_open(...).get_slice``. torch ``.pt`` / ``.bin``
files cannot be: they are memory-mapped (``torch.load(mmap=True)``, zip files) and the rank's
slices copied out of the map, so only the pages of those slices are read; a legacy non-zip
file is loaded whole on every rank.

Before anything is loaded every rank checks its names and shapes against the file, and all
ranks agree on the outcome: a missing, unexpected or wrongly shaped entry anywhere raises
the same ``CheckpointError`` on every rank, with the model left as it was.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.export import HF_WEIGHTS, hf_info, require_safetensors
from lightning_5d.checkpoint.sharded import is_sharded_checkpoint
from lightning_5d.parallel.regions import dtensor_region, local_tensor, read_region, splits_region

HF_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# safetensors' dtype names (the file's header) as torch dtypes.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8}  # fmt: skip


def _checkpoint_error(message: str) -> Exception:
    return CheckpointError(message)


# ---------------------------------------------------------------------- sources
class StateSource:
    """Names and shapes of a state dict on disk; each entry read a slice at a time.

    ``read(key, index)`` returns ``file_tensor[index]`` (``index``: a tuple of slices) without
    reading the rest of the tensor: from safetensors through ``safe_open(...).get_slice``, the
    file opened per entry so that no mapping of already read pages outlives it; from a torch
    file through its memory map (or, for legacy non-zip files, from the loaded dict)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._shape: dict[str, tuple[int, ...]] = {}
        self._bytes: dict[str, int] = {}
        self._read: dict[str, Callable[[str, tuple], Tensor]] = {}
        self._raw: dict[str, _RawEntry] = {}  # safetensors entries: where their bytes lie in the file

    def keys(self) -> list[str]:
        return list(self._shape)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def nbytes(self, key: str) -> int:
        return self._bytes[key]

    def read(self, key: str, index: tuple) -> Tensor:
        """``file_tensor[index]`` of entry ``key``; only that part is read."""
        return self._read[key](key, index)

    def read_into(self, key: str, index: tuple, out: Tensor) -> bool:
        """Read ``file_tensor[index]`` straight into ``out`` when it is one run of the file's bytes
        in ``out``'s dtype and ``out`` is contiguous (a row block of a tensor, as ZeRO-3 and a
        column-parallel cut take them); False, with nothing read, otherwise. No tensor is made
        for the slice and no page of the file is mapped: the load holds only the model."""
        raw = self._raw.get(key)
        if raw is None or raw.dtype != out.dtype or not out.is_contiguous() or sys.byteorder != "little":
            return False
        if out.device.type != "cpu":  # a GPU parameter: read through get_slice and copied over
            return False
        span = _byte_span(raw.shape, index, out.element_size())
        if span is None or span[1] != out.numel() * out.element_size():
            return False
        start, length = span
        buffer = out.detach().view(-1).view(torch.uint8).numpy()  # out's own memory, as bytes
        with open(raw.file, "rb", buffering=0) as f:
            f.seek(raw.offset + start)
            got = 0
            while got < length:
                n = f.readinto(buffer[got:])
                if not n:
                    raise CheckpointError(f"{raw.file}: entry {key!r} ends before its header says (the file is "
                                          f"truncated); download or copy it again")  # fmt: skip
                got += n
        return True

    def get(self, key: str) -> Tensor:
        """The whole entry (export and tests; loading reads slices)."""
        return self.read(key, tuple(slice(None) for _ in self._shape[key]))

    # --- adding files
    def add_safetensors(self, file: Path, only: set[str] | None = None) -> None:
        require_safetensors()
        from safetensors import safe_open

        raw = _raw_entries(file)
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                if only is not None and key not in only:
                    continue
                piece = handle.get_slice(key)
                shape = tuple(piece.get_shape())
                self._shape[key] = shape
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                self._bytes[key] = _numel(shape) * (dtype.itemsize if dtype is not None else 1)
                self._read[key] = functools.partial(_safetensors_slice, str(file))
                self._raw.pop(key, None)  # a key added again from another file
                if key in raw and raw[key].shape == shape:
                    self._raw[key] = raw[key]

    def add_torch(self, file: Path, only: set[str] | None = None) -> None:
        state = _torch_load(file)
        for key, value in state.items():
            if not isinstance(value, Tensor) or (only is not None and key not in only):
                continue
            self._shape[key] = tuple(value.shape)
            self._bytes[key] = value.numel() * value.element_size()
            self._read[key] = lambda k, index, state=state: state[k][index] if index else state[k]


@dataclass(frozen=True)
class _RawEntry:
    """Where one safetensors entry's bytes lie: the file, the offset of its first byte, its
    dtype and shape (row-major, little-endian, as the format stores every tensor)."""

    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _raw_entries(file: Path) -> dict[str, _RawEntry]:
    """The entries of a safetensors file from its header (8-byte little-endian length, then JSON
    ``{name: {dtype, shape, data_offsets}}``; the data follow it). Empty if the header is not one."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= 100 * 2**20:
                return {}
            header = json.loads(f.read(length))
    except (OSError, ValueError):
        return {}  # safe_open reports a damaged file; slices are then read its way
    found = {}
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
            continue
        begin, _ = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        found[key] = _RawEntry(str(file), 8 + length + begin, dtype, tuple(entry["shape"]))
    return found


def _byte_span(shape: tuple[int, ...], index: tuple, itemsize: int) -> tuple[int, int] | None:
    """(first byte, length) of ``tensor[index]`` in a row-major tensor of ``shape``, when those
    elements are one run: the dims after the last one the index cuts are whole, the ones before
    it taken one index at a time. None otherwise."""
    if len(index) != len(shape):
        return None
    bounds = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(dim)
        if step != 1 or stop < start:
            return None
        bounds.append((start, stop))
    cut = [d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])]
    if any(b - a != 1 for a, b in bounds[: cut[-1] if cut else 0]):  # before the last cut dim: one index each
        return None
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    first = sum(a * st for (a, _), st in zip(bounds, strides))
    count = _numel(tuple(b - a for a, b in bounds))
    return first * itemsize, count * itemsize


def _safetensors_slice(file: str, key: str, index: tuple) -> Tensor:
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as handle:
        piece = handle.get_slice(key)
        return piece[index] if index else handle.get_tensor(key)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _torch_load(file: Path) -> Mapping[str, Any]:
    try:
        try:  # memory-mapped: only the entries we touch are read
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # legacy (non-zip) files cannot be mapped
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise _checkpoint_error(
            f"{file} could not be read as a state dict with torch.load(weights_only=True) ({type(err).__name__}: {err})"
        ) from err
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]  # a full Lightning checkpoint: its model weights
    if not isinstance(state, Mapping):
        raise _checkpoint_error(f"{file} holds a {type(state).__name__}, not a state dict (a dict of tensors).")
    return state


def _index(file: Path) -> dict[str, list[str]]:
    """A Hugging Face shard index: file name -> the entries it holds."""
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except Exception as err:
        raise _checkpoint_error(f"{file} is not a Hugging Face weight index ({type(err).__name__}: {err})") from err
    files: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        files.setdefault(name, []).append(key)
    return files


def open_state(path: str | os.PathLike) -> StateSource:
    """A :class:`StateSource` for a state-dict file or a Hugging Face folder."""
    path = Path(path)
    if not path.exists():
        raise _checkpoint_error(f"pretrained weights {path} do not exist.")
    source = StateSource(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            source.add_safetensors(path)
        else:
            source.add_torch(path)
        return source
    if is_sharded_checkpoint(path):
        raise _checkpoint_error(
            f"{path} is a lightning_5d sharded checkpoint: resume it with Trainer.fit(ckpt_path=...), or turn it into "
            f"pretrained weights with `l5d export {path} weights.safetensors`."
        )
    for index, add in ((HF_INDEX, source.add_safetensors), (BIN_INDEX, source.add_torch)):
        if (path / index).is_file():
            for name, keys in _index(path / index).items():
                if not (path / name).is_file():
                    raise _checkpoint_error(f"{path / index} names {name}, which is not in {path}.")
                add(path / name, set(keys))
            return source
    for name, add in ((HF_WEIGHTS, source.add_safetensors), (BIN_WEIGHTS, source.add_torch)):
        if (path / name).is_file():
            add(path / name)
            return source
    raise _checkpoint_error(
        f"{path} is a folder without {HF_WEIGHTS}, {HF_INDEX}, {BIN_WEIGHTS} or {BIN_INDEX}; pass a Hugging Face "
        f"model folder or a .safetensors / .pt file."
    )


# ---------------------------------------------------------------------- checking
@dataclass
class PretrainedLoad:
    """What :func:`load_pretrained` did on this rank."""

    path: Path
    prefix: str
    loaded: int  # entries this rank read
    bytes_read: int  # bytes this rank read from the file (its share of the entries it holds)
    missing: list[str] = field(default_factory=list)  # only with strict=False
    unexpected: list[str] = field(default_factory=list)


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """state_dict name -> every name of the same tensor (tied weights appear under several names)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    for name, b in module.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _splits(strategy: Any) -> list:
    """FiveDStrategy's tp / ep / pp splits (each with ``local_state``: full tensors -> this rank's pieces)."""
    checkpoints = getattr(strategy, "checkpoints", None)
    return list(checkpoints.splits) if checkpoints is not None else []


def _local_shapes(strategy: Any, full: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shapes this rank keeps of full tensors (through the strategy's tp/ep/pp splits)."""
    splits = _splits(strategy)
    return {k: splits_region(k, shape, splits).local_shape for k, shape in full.items()}


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _choose_prefix(prefix: str | None, module: nn.Module, file_keys: list[str], model_keys: set[str]) -> str:
    if prefix is not None:
        return prefix
    candidates = [""]
    info = hf_info(module)
    if info is not None:
        # The Hugging Face model's attribute path, and its base model's: Hub files saved from the base
        # model (GPT-2's "h.0..." for GPT2LMHeadModel's "transformer.h.0...") name entries without it.
        base = getattr(module.get_submodule(info["prefix"].rstrip(".")), "base_model_prefix", "")
        candidates += [info["prefix"], f"{info['prefix']}{base}." if base else None]
    # The prefix under which most of the file's names are the model's (ties: the first candidate).
    counts = {p: sum(f"{p}{k}" in model_keys for k in file_keys) for p in dict.fromkeys(candidates) if p is not None}
    return max(counts, key=counts.__getitem__)


def _hf_ignored(module: nn.Module) -> tuple[list[re.Pattern], list[re.Pattern]]:
    """The Hugging Face model's own ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` patterns
    (GPT-2 files on the Hub hold ``attn.bias`` causal masks its modules no longer keep)."""
    info = hf_info(module)
    if info is None:
        return [], []
    model = module.get_submodule(info["prefix"].rstrip("."))
    return tuple(  # type: ignore[return-value]
        [re.compile(p) for p in (getattr(model, attr, None) or ())]
        for attr in ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")
    )


def _conversion_hint(path: Path) -> str | None:
    """For a Hugging Face folder of a model type whose weights transformers renames / fuses while loading."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        model_type = json.loads(config.read_text()).get("model_type")
        if not get_checkpoint_conversion_mapping(model_type):
            return None
    except Exception:  # no transformers, or another version's internals: no hint
        return None
    return (
        f"  {path} holds {model_type} weights under the names transformers converts while loading (e.g. one tensor "
        f"per expert, fused into one [experts, ...] tensor in memory); load_pretrained reads entries as they are "
        f"stored. Convert the folder once in one process: "
        f"`save_safetensors(AutoModelForCausalLM.from_pretrained(src).state_dict(), dst)` "
        f"(lightning_5d.checkpoint.export.save_safetensors), and load dst."
    )


def _problems(
    strategy: Any, source: StateSource, prefix: str, local: Mapping[str, Tensor], all_keys: set[str]
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, shape mismatches) of this rank."""
    aliases = _aliases(strategy.lightning_module)
    in_file = {f"{prefix}{k}" for k in source.keys()}
    ignore_missing, ignore_unexpected = _hf_ignored(strategy.lightning_module)
    missing = [
        k
        for k in local
        if not any(a in in_file for a in aliases.get(k, [k])) and not any(p.search(k) for p in ignore_missing)
    ]
    unexpected = sorted(
        k for k in in_file if k not in all_keys and not any(p.search(k[len(prefix) :]) for p in ignore_unexpected)
    )
    present = [k for k in local if k in in_file]
    mismatched = []
    try:
        shapes = _local_shapes(strategy, {k: source.shape(k[len(prefix) :]) for k in present})
    except Exception as err:  # a split that cannot cut the file's tensor (not divisible by tp, ...)
        return missing, unexpected, [f"the file's tensors cannot be split for this layout ({err})"]
    for k in present:
        want = tuple(local[k].shape)
        if shapes.get(k) != want:
            mismatched.append(
                f"{k}: file {list(source.shape(k[len(prefix) :]))} -> {list(shapes.get(k, ()))} on this rank, "
                f"model {list(want)}"
            )
    return missing, unexpected, mismatched


def _report(path: Path, prefix: str, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    def listed(names: list[str]) -> str:
        return ", ".join(names[:12]) + (f" ... ({len(names)} in all)" if len(names) > 12 else "")

    lines = [f"pretrained weights {path} do not match the model (names in the model = {prefix!r} + names in the file):"]
    if missing:
        lines.append(f"  missing in the file: {listed(missing)}")
    if unexpected:
        lines.append(f"  not in the model: {listed(unexpected)}")
    if mismatched:
        lines.append(f"  wrong shapes: {listed(mismatched)}")
    lines.append("  Pass prefix= (the attribute path of the pretrained model in the LightningModule, e.g. 'model.'), ")
    lines.append("  or strict=False to load the entries that match and leave the rest as initialized.")
    hint = _conversion_hint(path) if missing or unexpected else None
    if hint:
        lines.append(hint)
    return "\n".join(lines)


# ---------------------------------------------------------------------- loading
def _targets(module: nn.Module, names: list[str]) -> list[tuple[str, Tensor]]:
    """(name, live tensor) for each name, every tensor once (tied weights appear under several names)."""
    live = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    out = []
    for name in names:
        t = live[name]
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def load_pretrained(
    strategy: Any,
    path: str | os.PathLike,
    prefix: str | None = None,
    strict: bool = True,
) -> PretrainedLoad:
    """Load the state dict at ``path`` into ``strategy.lightning_module``, already parallelized.

    ``prefix`` is put in front of the file's names to get the LightningModule's (``"model."``
    for weights of ``self.model``); None (default) picks ``""`` or the attribute path of the
    Hugging Face model inside the LightningModule, whichever matches more names. Every rank of
    the world must call this together: the names are agreed on over all ranks. With
    ``strict=True`` a missing or unexpected entry raises ``CheckpointError`` on every rank
    before anything is loaded; a wrong shape always does.

    Each rank reads, tensor by tensor, only the part it holds: the tp / ep cuts of the file's
    tensor (``split.local_region``) narrowed to the rank's FSDP2 shard (a DTensor's local
    piece), rectangle by rectangle (a fused ``[q|k|v]`` cut reads one rectangle per segment),
    straight into the live parameter. Nothing is sent between ranks, and the memory beyond the
    rank's own parameters is one rectangle of one tensor.
    """
    path = Path(path)
    try:
        source: StateSource | None = open_state(path)
        error = None
    except Exception as err:  # every rank fails together, also when only some could not read
        source, error = None, f"{type(err).__name__}: {err}"
    errors = [e for e in _gather(error) if e is not None]
    if errors:
        raise _checkpoint_error(errors[0] if error is None else error)
    assert source is not None
    module = strategy.lightning_module
    local = module.state_dict()  # this rank's entries: names of the unsplit model, local (or DTensor) shapes
    all_keys = set().union(*_gather(list(local)))
    file_keys = source.keys()
    prefix = _choose_prefix(prefix, module, file_keys, all_keys)
    missing, unexpected, mismatched = _problems(strategy, source, prefix, local, all_keys)
    found = _gather((missing, unexpected, mismatched))
    # In the model's order (rank by rank), so the first names listed are the first that differ.
    missing = list(dict.fromkeys(k for m, _, _ in found for k in m))
    unexpected = sorted({k for _, u, _ in found for k in u})
    mismatched = list(dict.fromkeys(k for _, _, s in found for k in s))
    if mismatched or (strict and (missing or unexpected)):
        raise _checkpoint_error(_report(path, prefix, missing, unexpected, mismatched))
    in_file = set(file_keys)
    mine = [k for k in local if k.startswith(prefix) and k[len(prefix) :] in in_file]
    splits = _splits(strategy)
    read = 0
    for name, target in _targets(module, mine):
        key = name[len(prefix) :]
        region = dtensor_region(splits_region(name, source.shape(key), splits), target)
        read += read_region(functools.partial(source.read, key), region, local_tensor(target),
                            read_into=functools.partial(source.read_into, key))  # fmt: skip
    checkpoints = getattr(strategy, "checkpoints", None)
    if hasattr(checkpoints, "after_model_load"):  # ZeRO-1/2 and bf16 masters copy the new weights
        checkpoints.after_model_load()
    return PretrainedLoad(path, prefix, len(mine), read, missing, unexpected)
