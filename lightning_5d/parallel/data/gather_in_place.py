"""ZeRO-3: gather a one-parameter FSDP2 unit straight into its unsharded parameter.

FSDP2 all-gathers a unit into one flat buffer (``foreach_all_gather``: for each rank r, the
padded shards of the unit's parameters, concatenated) and then copies each parameter's piece
into that parameter's own buffer (``foreach_all_gather_copy_out`` into
``FSDPParam.all_gather_outputs``, of which the unsharded parameter is a view). Until the flat
buffer goes, the unit is held twice: for the 0.5 B reference model's 188 MiB embedding or head,
+2 x 188 MiB per rank, the start-up peak with the verifier's probe on (benchmarks/RESULTS.md,
``startup_memory``) and again at every training gather of those units.

For a unit of exactly one parameter, sharded on dim 0, whose local tensor has no
``fsdp_pre_all_gather`` (FP8 all-gather weights do: their gathered bytes are not the
parameter's), the two layouts are the same: the flat buffer is ``world x padded shard`` and
the parameter's buffer is ``world x padded shard`` too (``init_all_gather_outputs``: input
numel x world; ``torch.chunk`` puts the padding only after the last real rows, so the unsharded
parameter is the buffer's first numel elements either way). :class:`InPlaceAllGather` is
FSDP2's public hook for this (``FSDPModule.set_custom_all_gather``): its ``allocate`` hands
back the parameter's own buffer (allocated there, as the copy-out would), the collective
writes into it (each rank's slice broadcast from that rank: gloo's own all-gather gathers into a
temporary of the unit's size first), and the copy-out becomes a copy of the buffer onto itself,
which ``copy_`` skips. The unit is held once. Values are the same bytes as FSDP2's own gather.

Why each condition holds in torch 2.13 (checked by tests/distributed/test_gather_in_place.py):

- mixed precision: the flat buffer's dtype is the all-gather input's, ``param_dtype`` when set,
  and so is the parameter buffer's (``init_all_gather_outputs`` takes the input dtypes);
- reshard frees the parameter buffer's storage (``free_storage``: ``resize_(0)``) and the next
  unshard's ``allocate`` re-allocates it (``alloc_storage``) before the collective writes it;
  the all-gather state FSDP2 keeps for the next unit's copy-in (``comm_ctx.all_gather_state``,
  dropped early by ``verify/probe_memory.drop_kept_gather``) then refers to freed storage and
  holds nothing;
- prefetch (forward, backward) and ``unshard(async_op=True)`` only move the time of the
  ``allocate`` earlier (and an async gather here finishes before ``unshard`` returns): the unit
  is sharded until its copy-out (``unshard`` returns at once for a unit already unsharded or
  with a gather pending), so nothing reads the buffer meanwhile;
- autograd: the buffer handed to FSDP2 is a second tensor on the same storage, not a view,
  so the collective's writes do not bump the version counter the unsharded parameter (saved
  for backward) shares with its buffer, as FSDP2's copy-out is careful not to;
- CPU only: on an accelerator the flat buffer is allocated on the all-gather copy-in stream
  and the parameter's buffer on the compute stream; handing the copy-in stream's block to the
  parameter would let the caching allocator reuse it for the next gather while compute still
  reads it (that needs ``record_stream`` on the compute stream, which ``allocate`` cannot see).

Anything else (several parameters, another shard dim, another device, a custom all-gather
already set, FSDP2 internals not where 2.13 has them) keeps FSDP2's default gather: see
:func:`eligible`. At run time ``allocate`` also falls back to a fresh buffer when the
parameter's buffer is not exactly the size and dtype asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.fsdp import FSDPModule, fully_shard

try:  # FSDP2's comm hook types live in private modules; without them nothing is installed.
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
except ImportError:  # pragma: no cover - depends on the torch build
    AllGather = None  # type: ignore[assignment,misc]
    DefaultAllGather = None  # type: ignore[assignment,misc]

# What an FSDPParam must offer for the in-place gather (torch 2.13 names).
_PARAM_API = ("all_gather_outputs", "init_all_gather_outputs", "alloc_all_gather_outputs", "fsdp_placement",
              "_sharded_local_tensor", "offload_to_cpu", "device")  # fmt: skip


def eligible(unit: nn.Module) -> Any | None:
    """The unit's one ``FSDPParam`` when its gather can land in place, else ``None``."""
    if AllGather is None or not isinstance(unit, FSDPModule) or not hasattr(unit, "set_custom_all_gather"):
        return None
    return one_param(getattr(fully_shard.state(unit), "_fsdp_param_groups", None))


def one_param(groups: Any) -> Any | None:
    """The ``FSDPParam`` of a unit's param groups (FSDP2 internals, as in torch 2.13) when there is
    exactly one, sharded on dim 0 of a CPU tensor, without an all-gather extension, gathered by
    FSDP2's default comm; ``None`` for anything else, or when the internals are not as expected."""
    if not isinstance(groups, list) or len(groups) != 1:
        return None
    group = groups[0]
    # Exactly FSDP2's default comm: a user's or torch's own (symmetric memory, process-group
    # allocation) custom all-gather is left alone.
    if DefaultAllGather is None or type(getattr(group, "_all_gather_comm", None)) is not DefaultAllGather:
        return None
    params = getattr(group, "fsdp_params", None)
    if not isinstance(params, list) or len(params) != 1:
        return None
    param = params[0]
    if not all(hasattr(param, name) for name in _PARAM_API) or not isinstance(param.all_gather_outputs, list):
        return None
    if getattr(param.fsdp_placement, "dim", None) != 0 or param.offload_to_cpu:
        return None
    if hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather"):
        return None  # FP8 all-gather: the gathered bytes are the extension's, not the parameter
    if torch.device(param.device).type != "cpu":
        return None  # see the module docstring: stream ownership on accelerators
    return param


if AllGather is not None:

    class InPlaceAllGather(AllGather):  # type: ignore[misc,valid-type]
        """FSDP2's all-gather of one unit, whose output buffer is its one parameter's own."""

        def __init__(self, fsdp_param: Any) -> None:
            self.fsdp_param = fsdp_param
            self.in_place = 0  # gathers that landed in the parameter's buffer (tests read it)

        def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device):
            target = self._parameter_buffer(size, dtype, device)
            if target is None:
                return torch.empty(*size, dtype=dtype, device=device)
            self.in_place += 1
            # A new tensor on the buffer's storage, not a view of it: see "autograd" above.
            return torch.empty(0, dtype=dtype, device=device).set_(target.untyped_storage(), 0, target.shape)

        def _parameter_buffer(self, size, dtype, device) -> torch.Tensor | None:
            if len(size) != 1:
                return None
            numel, param = int(size[0]), self.fsdp_param
            # Creates the buffer the copy-out would create (numel x 1 = input numel x world);
            # a no-op once it exists.
            param.init_all_gather_outputs([numel], [dtype], 1, device)
            outputs = param.all_gather_outputs
            if len(outputs) != 1:
                return None
            out = outputs[0]
            fits = out.numel() == numel and out.dtype == dtype and out.device == torch.device(device)
            if not fits or not out.is_contiguous():
                return None
            param.alloc_all_gather_outputs()
            return out

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> dist.Work | None:  # fmt: skip
            """Each rank's slice broadcast from that rank, straight into ``output_tensor``.

            Not ``all_gather_single``: gloo's all-gather gathers into a flat tensor of its own and
            copies that out (ProcessGroupGloo's ``AsyncAllgatherWork``), which would bring back the
            second copy of the unit this class exists to avoid; its broadcast writes in place. Every
            rank still receives each other rank's shard once. ``input_tensor`` is this rank's slice
            of ``output_tensor`` (``all_gather_copy_in`` wrote it there). Done before returning, also
            under ``async_op``: FSDP2 then waits on nothing (a ``None`` work is a finished one).
            """
            world = group.size()
            shard = output_tensor.numel() // world
            for src in range(world):
                dist.broadcast(output_tensor.narrow(0, src * shard, shard), group=group, group_src=src)
            return None


def gather_in_place(units: Sequence[nn.Module]) -> int:
    """Give every eligible unit the in-place gather; returns how many got it."""
    done = 0
    for unit in units:
        param = eligible(unit)
        if param is not None:
            unit.set_custom_all_gather(InPlaceAllGather(param))  # type: ignore[operator]
            done += 1
    return done
