"""Export a checkpoint as a plain state dict or a Hugging Face folder: ``l5d export CKPT OUT``.

A checkpoint (a sharded directory or a full ``.ckpt`` file; a folder of checkpoints, such
as ``<run dir>/checkpoints`` of ``l5d train``, means the one its ``latest`` names) is consolidated in one process
without a process group and written as

- ``safetensors``: one ``.safetensors`` file of tensors (tied / shared tensors are cloned,
  since safetensors refuses tensors that share memory);
- ``pt``: ``torch.save`` of a plain ``{name: tensor}`` dict (loads with ``weights_only=True``);
- ``hf``: a folder ``from_pretrained`` loads: ``config.json`` (the config stored in the
  checkpoint's ``layout.json`` under ``"hf"``) and ``model.safetensors``.

The names are the LightningModule's with a prefix stripped: by default the attribute path
of the Hugging Face model inside the LightningModule (``"hf.prefix"`` of ``layout.json``,
e.g. ``"model."``), else none. Only entries under the prefix are exported; the others are
reported (``ExportResult.left_out``). Output goes to a hidden temporary name next to OUT
and is renamed when complete, so a failed export leaves nothing behind and an existing
OUT is replaced only with ``overwrite=True`` (``--overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.files import latest_checkpoint
from lightning_5d.checkpoint.sharded import is_sharded_checkpoint, read_layout, read_model_state

HF_EXTRA = "pip install 'lightning-5d[hf]'"
HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
_SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it


class ExportFormat(str, Enum):
    SAFETENSORS = "safetensors"
    PT = "pt"
    HF = "hf"


@dataclass
class ExportResult:
    path: Path
    format: ExportFormat
    prefix: str
    tensors: int
    bytes: int
    left_out: list[str] = field(default_factory=list)  # entries outside the prefix, or not tensors
    source: Path | None = None  # the checkpoint read (a folder's `latest`)

    def describe(self) -> str:
        text = f"read {self.source}\n" if self.source is not None else ""
        text += f"wrote {self.path} ({self.format.value}: {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB"
        text += f", prefix {self.prefix!r} stripped)" if self.prefix else ")"
        if self.left_out:
            shown = ", ".join(self.left_out[:8]) + (" ..." if len(self.left_out) > 8 else "")
            text += f"\nleft out {len(self.left_out)} entries outside the prefix or not tensors: {shown}"
        return text


def require_safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open  # noqa: F401
    except ImportError as err:
        raise ImportError(f"safetensors files need the `safetensors` package: {HF_EXTRA}") from err
    return safetensors


# ---------------------------------------------------------------------- Hugging Face info
def _transformers_class(model: nn.Module) -> type | None:
    """The first class of ``model``'s MRO defined by transformers (FSDP2 and user subclasses wrap it)."""
    return next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)


def hf_info(module: nn.Module) -> dict[str, Any] | None:
    """``{"prefix", "class", "config"}`` of the first Hugging Face model inside ``module``, else None.

    ``prefix`` is its attribute path in ``module.state_dict()`` names (``"model."`` for
    ``self.model = LlamaForCausalLM(...)``; ``""`` if ``module`` is the model itself),
    ``class`` the transformers class name (``from_pretrained`` of that class, or of
    ``AutoModelForCausalLM`` through ``config.json``'s ``architectures``), ``config`` the
    JSON-ready dict ``save_pretrained`` would write. Everything is JSON-serializable.
    transformers is not imported here: a module can only hold a Hugging Face model if it
    was imported already, so without it the answer is None.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    base = transformers.PreTrainedModel
    for name, sub in module.named_modules():
        if isinstance(sub, base):
            cls = _transformers_class(sub) or type(sub)
            config = json.loads(sub.config.to_json_string(use_diff=True))
            config = {k: v for k, v in config.items() if not k.startswith("_")}  # runtime-only settings
            config["architectures"] = [cls.__name__]
            return {"prefix": f"{name}." if name else "", "class": cls.__name__, "config": config}
    return None


# ---------------------------------------------------------------------- reading
def checkpoint_hf(path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``"hf"`` entry a checkpoint recorded (layout.json of a sharded one; a full file's ``"layout"``)."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        layout = read_layout(path)
    else:
        try:
            whole = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # read_model_state reports unreadable files with the full message
            return None
        layout = whole.get("layout") if isinstance(whole, Mapping) else None
    hf = layout.get("hf") if isinstance(layout, Mapping) else None
    return dict(hf) if isinstance(hf, Mapping) else None


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself, or for a folder of checkpoints the one its ``latest`` names (falling back
    past a damaged one to the newest intact checkpoint of the same run)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    if path.is_dir() and not is_sharded_checkpoint(path):
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        raise CheckpointError(
            f"{path} is a directory but neither a complete lightning_5d sharded checkpoint (no COMPLETE marker or "
            f"layout.json) nor a folder of complete checkpoints: pass a checkpoint written by trainer.save_checkpoint "
            f"(a directory or a .ckpt file) or the folder that holds them (e.g. <run dir>/checkpoints)."
        )
    return path


def select_tensors(state: Mapping[str, Any], prefix: str) -> tuple[dict[str, Tensor], list[str]]:
    """Entries under ``prefix`` with it stripped, and the names left out (other prefixes, non-tensors)."""
    out: dict[str, Tensor] = {}
    left_out: list[str] = []
    for name, value in state.items():
        if not name.startswith(prefix) or not isinstance(value, Tensor) or name == prefix:
            left_out.append(name)
            continue
        out[name[len(prefix) :]] = value.detach()
    return out, left_out


def untie(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous CPU tensors, each with its own memory: tied weights (an embedding and its head)
    share storage, which safetensors refuses; the second name gets a copy."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        if t.numel() > 0:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key in seen:
                t = t.clone()
            seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        out[name] = t.contiguous()
    return out


# ---------------------------------------------------------------------- writing
def _tmp_name(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` goes only after that worked."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not overwrite:  # checked before writing too; someone may have created it meanwhile
        raise FileExistsError(f"{out} exists; replace it with overwrite=True.")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old) if old.is_dir() else old.unlink()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def save_safetensors(state: Mapping[str, Tensor], path: Path) -> None:
    require_safetensors()
    from safetensors.torch import save_file

    save_file(untie(state), str(path), metadata=dict(_SAFETENSORS_METADATA))


def _write_hf(state: Mapping[str, Tensor], hf: Mapping[str, Any], folder: Path) -> None:
    folder.mkdir()
    config = dict(hf["config"])
    config.setdefault("architectures", [hf["class"]])
    (folder / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_safetensors(state, folder / HF_WEIGHTS)


def _infer_format(out: Path, hf: Mapping[str, Any] | None) -> ExportFormat:
    suffix = out.suffix.lower()
    if suffix == ".safetensors":
        return ExportFormat.SAFETENSORS
    if suffix in (".pt", ".pth", ".bin"):
        return ExportFormat.PT
    if hf is not None:
        return ExportFormat.HF
    raise ValueError(
        f"cannot tell the format from {out.name!r}: name it *.safetensors or *.pt, or choose the format "
        f"(safetensors, pt or hf)."
    )


def export_checkpoint(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    format: str | ExportFormat | None = None,
    prefix: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Consolidate the checkpoint ``ckpt`` (sharded directory or full ``.ckpt``, or a folder of
    them: its ``latest``) into ``out``.

    ``format``: ``"safetensors"``, ``"pt"`` or ``"hf"``; None takes it from ``out``'s suffix
    (a folder name means ``hf`` when the checkpoint recorded a Hugging Face model).
    ``prefix``: stripped from the names, and only names under it are exported; None means the
    Hugging Face model's attribute path recorded in the checkpoint, else ``""`` (everything).
    Raises ``CheckpointError`` (unreadable checkpoint), ``ValueError`` (bad arguments, or
    ``hf`` without a recorded Hugging Face model), ``FileExistsError`` (``out`` exists and not
    ``overwrite``), ``ImportError`` (safetensors missing); nothing is written then.
    """
    given, out = Path(ckpt), Path(out)
    ckpt = resolve_checkpoint(given)
    hf = checkpoint_hf(ckpt)
    fmt = _infer_format(out, hf) if format is None else ExportFormat(format)
    if fmt == ExportFormat.HF and hf is None:
        raise ValueError(
            f"{ckpt} holds no Hugging Face model information (layout.json has no 'hf' entry: the LightningModule "
            f"had no transformers.PreTrainedModel inside, or the checkpoint is not a sharded one); export to "
            f"*.safetensors or *.pt instead."
        )
    if fmt == ExportFormat.HF and prefix is not None and prefix != hf["prefix"]:
        raise ValueError(f"format hf exports the Hugging Face model at {hf['prefix']!r}; leave out the prefix.")
    if fmt != ExportFormat.PT:
        require_safetensors()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; replace it with overwrite=True.")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the folder of {out} does not exist.")
    if prefix is None:
        prefix = hf["prefix"] if hf is not None else ""
    try:
        model_state = read_model_state(ckpt)
    except KeyError as err:  # a readable torch file that is not a Lightning checkpoint
        raise CheckpointError(f"{ckpt} is not a Lightning checkpoint: it has no {err} entry.") from err
    state, left_out = select_tensors(model_state, prefix)
    if not state:
        raise ValueError(
            f"{ckpt} has no tensors under the prefix {prefix!r}; pass another prefix ('' keeps every name)."
        )
    tmp = _tmp_name(out)
    try:
        if fmt == ExportFormat.HF:
            _write_hf(state, hf, tmp)
        elif fmt == ExportFormat.SAFETENSORS:
            save_safetensors(state, tmp)
        else:
            torch.save({k: v.to("cpu").contiguous() for k, v in state.items()}, tmp)
        _publish(tmp, out, overwrite)
    except BaseException:
        _remove(tmp)
        raise
    size = sum(t.numel() * t.element_size() for t in state.values())
    return ExportResult(out, fmt, prefix, len(state), size, left_out, source=ckpt if ckpt != given else None)


# ---------------------------------------------------------------------- l5d export
EXPORT_HELP = "consolidate a checkpoint to a plain state dict (.safetensors / .pt) or a Hugging Face folder"


def register(subparsers: Any) -> None:
    """Add ``l5d export`` to an argparse subparsers object."""
    cmd = subparsers.add_parser(
        "export",
        help=EXPORT_HELP,
        description=EXPORT_HELP + ". See docs/checkpoints.md (Export and import).",
    )
    cmd.add_argument(
        "ckpt",
        metavar="CKPT",
        help="a sharded checkpoint directory, a full .ckpt file, or a folder of them (its `latest` is read), "
        "e.g. <run dir>/checkpoints of l5d train",
    )
    cmd.add_argument("out", metavar="OUT", help="the file (.safetensors, .pt) or folder (hf) to write")
    cmd.add_argument(
        "--format",
        choices=[f.value for f in ExportFormat],
        default=None,
        help="default: from OUT's suffix; a name without one means hf for Hugging Face models",
    )
    cmd.add_argument(
        "--prefix",
        default=None,
        help="strip this prefix and export only the names under it (default: the Hugging Face model's attribute "
        "path recorded in the checkpoint, e.g. 'model.', else nothing); --prefix '' exports everything",
    )
    cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    cmd.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    try:
        result = export_checkpoint(args.ckpt, args.out, args.format, args.prefix, overwrite=args.overwrite)
    except ImportError as err:
        print(f"l5d export: {err}", file=sys.stderr)
        return 1
    except FileExistsError as err:  # the API's wording names the keyword; here the flag
        print(f"l5d export: {err.args[0].split(';')[0]}; pass --overwrite to replace it.", file=sys.stderr)
        return 2
    except (CheckpointError, ValueError, OSError) as err:
        print(f"l5d export: {err}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0
