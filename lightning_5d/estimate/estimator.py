"""One layout in, every prediction out: params, FLOPs, per-rank memory, communication, bubble."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .comm import CommEntry, bytes_by_dim, comm_per_step
from .flops import FlopsEstimate, training_flops, utilization
from .memory import MemoryBreakdown, rank_memory
from .params import ParamCounts, RankParams, count_params, rank_params
from .schedule import bubble_fraction, bubble_relative
from .spec import ModelSpec, load_spec
from .training import TrainingSetup, validate

# Written into every JSON result so a number is never read under the wrong convention.
CONVENTIONS = {
    "memory": "bytes on the most loaded rank, GiB = 2^30; ZeRO shards over dp_shard*cp",
    "model_state": "bf16 mixed, paper: 2 (param) + 2 (grad) + 12 (fp32 master, Adam m, v) bytes/param; "
    "runtime (default): + the fp32 master gradient at the step (Z0 2+4+12; Z1 2+(2+4/N)+12/N; Z2 2+4/N+12/N; "
    "Z3 FSDP2 fp32 shards 4/N+4/N+8/N); fp32 grad accumulation adds 4 bytes/param to grads",
    "activations": "Korthikanti et al. 2022 Table 2 terms, shape-aware (GQA, SwiGLU, MoE top-k, flash attention)",
    "flops": "model: 6*N_matmul + 12*L*s*h per token (no causal halving); hardware adds recompute",
    "comm": "bytes sent per rank per optimizer step, ring algorithms",
    "bubble_fraction": "bubble / total step time, e.g. (p-1)/(m+p-1)",
    "bubble_relative": "bubble / ideal compute time, e.g. (p-1)/m",
}


@dataclass(frozen=True)
class Estimate:
    spec: ModelSpec
    setup: TrainingSetup
    params: ParamCounts
    rank_params: RankParams
    flops: FlopsEstimate
    memory: MemoryBreakdown
    comm: tuple[CommEntry, ...]
    bubble_relative: float
    bubble_fraction: float

    @property
    def comm_bytes_per_step(self) -> dict[str, float]:
        return bytes_by_dim(self.comm)

    def mfu(self, step_time_s: float, peak_flops_per_gpu: float) -> float:
        """Model FLOPs utilization for a measured step time (recompute excluded)."""
        return utilization(self.flops.model_per_step, step_time_s, self.setup.world_size, peak_flops_per_gpu)

    def hfu(self, step_time_s: float, peak_flops_per_gpu: float) -> float:
        """Hardware FLOPs utilization (recompute included)."""
        return utilization(self.flops.hardware_per_step, step_time_s, self.setup.world_size, peak_flops_per_gpu)

    def to_dict(self) -> dict[str, Any]:
        """Stable keys; see docs/planner.md."""
        return {
            "model": self.spec.name,
            "setup": self.setup.as_dict(),
            "params": self.params.total,
            "params_active": self.params.active,
            "params_per_rank": self.rank_params.total,
            "flops_per_step": self.flops.model_per_step,
            "hardware_flops_per_step": self.flops.hardware_per_step,
            "flops_per_token": self.flops.model_per_token,
            "hardware_flops_per_token": self.flops.hardware_per_token,
            "tokens_per_step": self.flops.tokens_per_step,
            "memory_gib": self.memory.gib(),
            "memory_rank": f"pp stage {self.memory.stage.value}",
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm": [entry.as_dict() for entry in self.comm],
            "bubble_fraction": self.bubble_fraction,
            "bubble_relative": self.bubble_relative,
            "conventions": dict(CONVENTIONS),
        }


def estimate(
    model: Any,
    setup: TrainingSetup | None = None,
    *,
    gpus: int | None = None,
    gpus_per_node: int = 8,
    **setup_fields: Any,
) -> Estimate:
    """Predict one layout. ``model``: preset name, config.json path, ModelSpec or module.

    ``estimate("llama3-70b", tp=8, pp=4, dp_shard=4, zero=1, seq_len=4096)`` or
    ``estimate(spec, TrainingSetup(...))``. Raises ``LayoutError`` for layouts that cannot
    be built (and when ``gpus`` is given and the sizes do not multiply to it).
    """
    spec = load_spec(model)
    if setup is None:
        setup = TrainingSetup(**setup_fields)
    elif setup_fields:
        setup = setup.replace(**setup_fields)
    validate(spec, setup, gpus)
    counts = count_params(spec)
    memory = rank_memory(spec, setup, counts)
    rank = rank_params(spec, setup, memory.stage, counts)
    args = (setup.pp, setup.m, setup.v, setup.schedule)
    return Estimate(
        spec=spec,
        setup=setup,
        params=counts,
        rank_params=rank,
        flops=training_flops(spec, setup, counts),
        memory=memory,
        comm=tuple(comm_per_step(spec, setup, rank, memory.stage, gpus_per_node)),
        bubble_relative=bubble_relative(*args),
        bubble_fraction=bubble_fraction(*args),
    )
