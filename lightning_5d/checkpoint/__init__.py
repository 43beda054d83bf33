"""Checkpoints of the 5D strategy: the sharded and full formats, publishing, export and import."""

from lightning_5d.checkpoint.errors import CheckpointError
from lightning_5d.checkpoint.export import ExportFormat, ExportResult, export_checkpoint, hf_info
from lightning_5d.checkpoint.files import latest_checkpoint
from lightning_5d.checkpoint.full import (
    atomic_save,
    dcp_optimizer_state,
    full_model_state,
    load_dcp_optimizer_state,
    load_file,
    load_full_model_state,
)
from lightning_5d.checkpoint.pretrained import PretrainedLoad, load_pretrained
from lightning_5d.checkpoint.sharded import is_sharded_checkpoint, read_layout, read_model_state
from lightning_5d.checkpoint.options import CheckpointFormat, CheckpointWrite

__all__ = [
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointWrite",
    "ExportFormat",
    "ExportResult",
    "PretrainedLoad",
    "atomic_save",
    "dcp_optimizer_state",
    "export_checkpoint",
    "full_model_state",
    "hf_info",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "load_dcp_optimizer_state",
    "load_file",
    "load_full_model_state",
    "load_pretrained",
    "read_layout",
    "read_model_state",
]
