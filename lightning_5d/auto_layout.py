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
from lightning_5d.plan import ModelMappingError, discover
from lightning_5d.plan.kinds import in_features

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


def _model_spec(module: nn.Module, config: ParallelConfig):
    """The planner's shape of ``module``: from its config, else from what discovery observed."""
    from lightning_5d.estimate import ModelSpecError
    from lightning_5d.estimate.spec import spec_from_module

    try:
        return spec_from_module(module)
    except ModelSpecError as no_config:
        try:
            return _observed_spec(module, config.model_plan)
        except ModelMappingError as unmapped:
            raise ModelSpecError(f"{no_config} Discovery could not fill the gaps either: {unmapped}") from unmapped


def _observed_spec(module: nn.Module, model_plan):
    """A ModelSpec from the discovered plan of a model with no config object.

    A head count discovery could not find is given as 1: tensor parallelism (the only
    dimension that cuts by heads) then cannot be chosen, while dp, cp, pp and ZeRO can.
    """
    from lightning_5d.estimate.spec import MlpKind, ModelSpec, ModelSpecError

    plan = discover(module, model_plan)
    first = plan.block_plans[0]
    if first.mlp is None:
        raise ModelMappingError("the planner reads the MLP width of the first block, and discovery found no MLP there")
    row = module.get_submodule(f"{plan.block_path(0)}.{first.mlp.row[0].path}")
    gated = len(first.mlp.column) == 2 or bool(first.mlp.column[0].segments)
    attention = next(a for _, a in plan.attentions)  # an alternating list's first entry may be its MLP
    heads = attention.num_heads or 1
    try:
        return ModelSpec(
            vocab_size=plan.vocab_size,
            hidden_size=plan.hidden_size,
            intermediate_size=in_features(row),
            num_layers=plan.num_blocks,
            num_heads=heads,
            num_kv_heads=attention.num_kv_heads or heads,
            head_dim=attention.head_dim or plan.hidden_size,
            tie_embeddings=plan.tied_head,
            learned_positions=plan.position_embedding is not None,
            mlp=MlpKind.SWIGLU if gated else MlpKind.GELU,
            name=type(module).__name__,
        )
    except (TypeError, ValueError) as err:
        raise ModelSpecError(f"the discovered shape of {type(module).__name__} is not one the planner models: {err}")


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
            _model_spec(module, config),
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
