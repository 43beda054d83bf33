"""The planner: predict params, FLOPs, per-GPU memory, communication and pipeline bubble for a
layout, and search the layouts of a cluster for the fastest one that fits.

    from lightning_5d.estimate import estimate, plan, choose_layout
    est = estimate("llama3-70b", tp=8, pp=4, dp_shard=4, zero=1, seq_len=4096)
    est.memory.gib(); est.comm_bytes_per_step; est.mfu(step_time_s=5.0, peak_flops_per_gpu=989e12)

Formulas and conventions: docs/planner.md.
"""

from lightning_5d.config import ActivationCheckpointing, LayoutError, PipelineSchedule, ZeroStage

from .comm import Collective, CommEntry, Link, bytes_by_dim, comm_per_step, ring_bytes
from .estimator import CONVENTIONS, Estimate, estimate
from .flops import FlopsEstimate, training_flops, utilization
from .memory import GIB, MemoryBreakdown, activation_memory, layer_activations, model_state_bytes, rank_memory
from .params import ParamCounts, Stage, count_params, rank_params
from .report import estimate_json, format_estimate, format_plan, plan_json
from .schedule import bubble_fraction, bubble_relative, in_flight_layer_microbatches
from .search import NoLayoutFitsError, PlanEntry, choose_layout, enumerate_setups, plan
from .spec import (
    PRESETS,
    MlpKind,
    ModelSpec,
    ModelSpecError,
    NormKind,
    get_preset,
    load_spec,
    spec_from_hf_config,
    spec_from_module,
)
from .timing import Cluster, StepTime, predict_step_time
from .training import AttentionKernel, Precision, TrainingSetup, validate

__all__ = [
    "PRESETS",
    "ActivationCheckpointing",
    "AttentionKernel",
    "CONVENTIONS",
    "Cluster",
    "Collective",
    "CommEntry",
    "Estimate",
    "FlopsEstimate",
    "GIB",
    "LayoutError",
    "Link",
    "MemoryBreakdown",
    "MlpKind",
    "ModelSpec",
    "ModelSpecError",
    "NoLayoutFitsError",
    "NormKind",
    "ParamCounts",
    "PipelineSchedule",
    "PlanEntry",
    "Precision",
    "Stage",
    "StepTime",
    "TrainingSetup",
    "ZeroStage",
    "activation_memory",
    "bubble_fraction",
    "bubble_relative",
    "bytes_by_dim",
    "choose_layout",
    "comm_per_step",
    "count_params",
    "enumerate_setups",
    "estimate",
    "estimate_json",
    "format_estimate",
    "format_plan",
    "get_preset",
    "in_flight_layer_microbatches",
    "layer_activations",
    "load_spec",
    "model_state_bytes",
    "plan",
    "plan_json",
    "predict_step_time",
    "rank_memory",
    "rank_params",
    "ring_bytes",
    "spec_from_hf_config",
    "spec_from_module",
    "training_flops",
    "utilization",
    "validate",
]
