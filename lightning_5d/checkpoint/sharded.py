"""The sharded format on disk: torch.distributed.checkpoint files, plus what is not a tensor.

Layout of one checkpoint directory::

    .metadata, __<rank>_0.distcp   DCP: every rank writes the tensors it owns
    meta.pt                        Lightning's checkpoint minus the tensors above (loops,
                                   callbacks, schedulers, precision state), read weights_only
    layout.json                    the layout that wrote it, and Hugging Face details if any
    COMPLETE                       written last: the writers all finished; the step, and
                                   each file's size and a hash of its ends (checked at load)

Tensor keys are the unsplit model's names, so any layout can ask for the pieces it needs:
``model.<LightningModule state_dict key>`` and ``optim.<i>.state.<param name>.<stat>``
(every rank's RNG states are in ``meta.pt``). Nothing here unpickles arbitrary objects: DCP's tensor payloads
are read with ``weights_only``, ``meta.pt`` too, and ``.metadata`` through an unpickler that
only builds DCP's own metadata classes.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.files import COMPLETE, damage, stamp_files
from lightning_5d.checkpoint.full import load_file
from lightning_5d.parallel.regions import Region

FORMAT_VERSION = 1
META = "meta.pt"
LAYOUT = "layout.json"
MODEL = "model."
OPTIM = "optim."

# The classes DCP's .metadata pickle may build; anything else is refused, not executed.
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"ExtensionRegistry"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "strided", "sparse_coo"}
    | {str(d).split(".")[-1] for d in torch.__dict__.values() if isinstance(d, torch.dtype)},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with its one raw ``pickle.load`` replaced by an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError as err:
            raise CheckpointError(
                f"{self.path} has no .metadata: not a sharded checkpoint, or an unfinished one."
            ) from err
        except Exception as err:
            raise CheckpointError(
                f"{path} could not be read ({type(err).__name__}: {err}); the checkpoint is corrupt or was not "
                f"written by torch.distributed.checkpoint. Resume from an earlier one; nothing was changed."
            ) from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").exists()


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """key -> (full size, dtype) of every tensor stored in a sharded checkpoint."""
    metadata = SafeReader(str(path)).read_metadata()
    return {
        k: (m.size, m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def check_complete(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a checkpoint directory or .ckpt file.")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker: its save never finished). Resume from "
            f"the folder's `latest` instead (lightning_5d.checkpoint.latest_checkpoint({str(path.parent)!r}))."
        )
    for name in (".metadata", META, LAYOUT):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}; it is truncated. Resume from an earlier one.")
    problem = damage(path)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {problem}. Resume from an earlier one (the folder's `latest` falls "
            f"back to the newest intact checkpoint by itself); nothing was changed."
        )
    return path


# ---------------------------------------------------------------------------- writing
def write_tensors(
    tensors: dict[str, torch.Tensor], directory: Path, group: Any | None = None, asynchronous: bool = False
) -> Future | None:
    """Every rank calls this with the tensors it holds; keys several ranks hold are written once."""
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True)
    if asynchronous:
        # The writer stages (copies) the tensors before returning, so training may change them.
        return dcp.async_save(tensors, storage_writer=writer, process_group=group)
    dcp.save(tensors, storage_writer=writer, process_group=group)
    return None


def serialize(meta: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(meta), buffer)
    return buffer.getvalue()


def write_extras(directory: Path, meta: Mapping[str, Any] | bytes, layout: Mapping[str, Any], step: int = -1) -> None:
    """Rank 0, after every rank's tensors are on disk; COMPLETE goes last, stamping every file."""
    (directory / META).write_bytes(meta if isinstance(meta, bytes) else serialize(meta))
    (directory / LAYOUT).write_text(json.dumps({"format": FORMAT_VERSION, **layout}, indent=1, default=str))
    stamp = stamp_files(directory, step)
    with open(directory / COMPLETE, "w") as f:
        f.write(stamp)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------- reading
def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    path = check_complete(path)
    try:
        with torch.serialization.safe_globals(_lightning_safe_globals()):
            return torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"{path / META} could not be read safely ({type(err).__name__}: {err}). If it names a class of "
            f"yours stored in hyper-parameters, allow it with torch.serialization.add_safe_globals([...]); "
            f"otherwise the file is corrupt. Nothing was changed."
        ) from err


def read_layout(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads((path / LAYOUT).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path / LAYOUT} could not be read ({err}); the checkpoint is truncated.") from err


class _RegionPlanner(DefaultLoadPlanner):
    """DCP's load planner asked for regions of the stored (full-shape) tensors: each key's
    rectangles (``Region.blocks``) become DCP's local chunks, read straight into views of the
    key's output tensor. DCP's resharding finds the stored chunks each rectangle overlaps."""

    def __init__(self, regions: Mapping[str, tuple[Region, torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions
        self._dest: dict[str, list[torch.Tensor]] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for key, (region, out) in self.regions.items():
            chunks, dests = [], []
            for full, local in region.blocks():
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(s.start for s in full),
                                                   sizes=torch.Size(s.stop - s.start for s in full)))  # fmt: skip
                dests.append(out[local])
            self._dest[key] = dests
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dest[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, offset, length)
        return dest


def read_regions(path: str | os.PathLike, regions: Mapping[str, tuple[Region, torch.Tensor]]) -> None:
    """Fill each ``out`` of ``regions`` (key -> (region of the stored tensor, out tensor of the
    region's local shape)) from the checkpoint, reading only the stored chunks the region
    overlaps, one at a time (a collective: every rank calls it, with its own regions)."""
    _load(path, {key: out for key, (_, out) in regions.items()}, planner=_RegionPlanner(regions))


def read_tensors(path: str | os.PathLike, targets: dict[str, torch.Tensor], group: Any | None = None) -> None:
    """Fill ``targets`` (full-shape tensors, or DTensors) in place from the checkpoint."""
    _load(path, targets, group=group)


def read_tensors_alone(path: str | os.PathLike, targets: dict[str, torch.Tensor]) -> None:
    """``read_tensors`` by this process alone (no collective): for reads only some ranks may make."""
    _load(path, targets, alone=True)


def _load(
    path: str | os.PathLike, targets: dict[str, torch.Tensor], group: Any = None, planner: Any = None,
    alone: bool = False,
) -> None:  # fmt: skip
    reader = SafeReader(str(path))
    try:
        dcp.load(
            targets, storage_reader=reader, planner=planner, process_group=group,
            no_dist=alone or not dist.is_initialized(),
        )  # fmt: skip
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's own error is a BaseException
        problem = damage(Path(path)) or _short_file(Path(path))
        raise CheckpointError(
            f"reading tensors from {path} failed: {problem or _cause(err)}. "
            f"{'' if problem else 'A data file is missing or truncated; '}resume from an earlier checkpoint. "
            f"Nothing was changed on disk."
        ) from err


def _cause(err: BaseException) -> str:
    """Each failing rank's own error (DCP wraps them with whole tracebacks), and the files it read."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(err).__name__}: {err}"
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(failures.items()))


def _short_file(path: Path) -> str | None:
    """A data file shorter than the byte ranges DCP's metadata says it holds (checkpoints without stamps)."""
    try:
        storage = SafeReader(str(path)).read_metadata().storage_data or {}
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception:
        return None
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} has {file.stat().st_size} bytes, the metadata says {size} (truncated)"
    return None


def read_model_state(path: str | os.PathLike, prefix: str = MODEL) -> dict[str, torch.Tensor]:
    """One process, no process group: the whole model state of a sharded checkpoint, consolidated
    (keys without ``prefix``), or a full-format file's ``state_dict``."""
    path = Path(path)
    if path.is_file():
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        whole = load_file(TorchCheckpointIO(), path, weights_only=True)
        if not isinstance(whole, Mapping) or "state_dict" not in whole:
            raise CheckpointError(f"{path} is a torch file without a 'state_dict': not a Lightning checkpoint.")
        return dict(whole["state_dict"])
    check_complete(path)
    shapes = tensor_shapes(path)
    targets = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in shapes.items() if k.startswith(prefix)}
    read_tensors(path, targets)
    return {k[len(prefix) :]: v for k, v in targets.items()}


def listing(label: str, items: list[str], shown: int = 8) -> str:
    """'  label (n): a, b, ...' for error messages that name what does not match."""
    more = " ..." if len(items) > shown else ""
    return f"  {label} ({len(items)}): {', '.join(items[:shown])}{more}"


def _lightning_safe_globals() -> list:
    # Lightning stores hyper-parameters as an AttributeDict; it is a plain dict subclass.
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict, pathlib.PosixPath, pathlib.WindowsPath]
