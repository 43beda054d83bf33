"""The layout ``strategy="5d"`` trains with when the user gives no sizes: the planner's pick.

The planner ranks every layout of the available dimensions by predicted step time for
this model and world. If it cannot read the model's shape, or nothing fits, training
still starts, as plain data parallelism with ZeRO-1, and the log says why.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_5d.config import IMPLEMENTED_DIMS, LayoutError, ParallelConfig

_FP32_PRECISIONS = ("32", "32-true", "64", "64-true")
# Not cp: at setup the planner cannot see the data's sequence length (it must divide by
# 2*cp) nor whether batches carry aligned labels, a contract cp needs and a user who gave
# no sizes never agreed to. Not pp either: the batch must split into the schedule's
# microbatches and the step must run the model's blocks, neither visible at setup. Not ep:
# it only helps MoE models, and the planner's auto layout is for any model.
# `l5d plan` ranks cp and pp layouts for a stated sequence length and batch.
AUTO_DIMS = IMPLEMENTED_DIMS - {"cp", "pp", "ep"}


def device_memory_gib(device: torch.device, local_processes: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    # CPU "devices" share the host's memory.
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / 2**30 / max(local_processes, 1)


def planned_config(
    config: ParallelConfig,
    module: nn.Module,
    world_size: int,
    *,
    precision: str,
    device: torch.device,
    local_processes: int,
) -> ParallelConfig:
    from lightning_5d.estimate import ModelSpecError, choose_layout

    try:
        chosen = choose_layout(
            module,
            world_size,
            available_dims=AUTO_DIMS,
            recompute=config.activation_checkpointing,
            precision="fp32" if str(precision) in _FP32_PRECISIONS else "bf16",
            gpus_per_node=local_processes,
            gpu_memory_gib=device_memory_gib(device, local_processes),
        )
    except (ModelSpecError, LayoutError) as err:
        rank_zero_warn(
            f"[lightning_5d] the planner could not choose a layout ({err}); training data parallel with "
            f"ZeRO-{int(config.zero)} over {world_size} ranks. Pass sizes to FiveDStrategy to choose yourself."
        )
        return config
    if chosen.get("tp", 1) > 1:
        chosen["sequence_parallel"] = True  # what the planner's memory and time estimates assumed
    planned = dataclasses.replace(config, **chosen)
    rank_zero_info(
        f"[lightning_5d] planner chose {', '.join(f'{k}={v}' for k, v in chosen.items())} for "
        f"{type(module).__name__} on {world_size} ranks; pass sizes to FiveDStrategy to override."
    )
    return planned
