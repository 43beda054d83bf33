"""Predicted step time: compute at an assumed efficiency + pipeline bubble + communication left exposed.

Which communication can hide behind compute, and behind which part of it:

* DP/ZeRO: as the runtime overlaps it (``overlap.py``): gradient buckets stream behind a
  backward, but the last bucket always trails it; ZeRO-1/2's post-step all-gather and the HSDP
  all-reduce across replicas are waited for with nothing to run beside them; ZeRO-3 streams
  layer by layer behind each microbatch.
* CP: ring hops overlap the attention-core compute of the block they feed; the all-to-alls of
  the alltoall and hybrid modes and the all-gather mode's collectives block attention (exposed).
* TP/SP, PP, EP: on the critical path (the next op needs the result) - fully exposed.

Each collective launch also pays a fixed latency (alpha), which is what makes ZeRO-3's
per-layer gathers and deep TP visible on small models. Overlap cannot beat bandwidth: the
step is never shorter than the time the busiest link (intra- or inter-node) needs to carry
all its traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_5d.config import ZeroStage

from .comm import DIMENSIONS, Collective, Link
from .estimator import Estimate
from .overlap import data_parallel_exposed
from .training import Precision

GIB = 2**30

# Dense peak per GPU (H100 SXM) by precision, used when neither `l5d plan
# --peak-tflops` nor a recipe's cluster section gives one.
DEFAULT_PEAK_TFLOPS = {
    Precision.BF16: 989.0,
    Precision.FP8: 1979.0,
    Precision.FP32: 494.0,
}  # fp32 runs as TF32


@dataclass(frozen=True)
class Cluster:
    """Hardware the plan targets. Defaults: an H100 SXM node (8 GPUs, NVLink, 400 Gb/s IB per GPU)."""

    gpus: int = 8
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 450e9  # bytes/s per GPU, one direction (NVLink 4)
    inter_node_bandwidth: float = 50e9  # bytes/s per GPU (400 Gb/s InfiniBand)
    peak_flops: float = 989e12  # dense bf16 per GPU
    compute_efficiency: float = 0.5  # achieved/peak for the model's matmuls; sets the predicted MFU ceiling
    memory_headroom: float = 0.1  # fraction kept free for the CUDA context, NCCL buffers, fragmentation
    latency_intra: float = 5e-6  # s per collective launch
    latency_inter: float = 20e-6

    @property
    def usable_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - self.memory_headroom)

    def bandwidth(self, link: Link) -> float:
        return self.intra_node_bandwidth if link == Link.INTRA else self.inter_node_bandwidth

    def latency(self, link: Link) -> float:
        return self.latency_intra if link == Link.INTRA else self.latency_inter


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds of (hardware) FLOPs at the assumed efficiency, bubble-free
    bubble: float
    comm: dict[str, float]  # seconds of traffic per dimension
    exposed: dict[str, float]  # the part of it that compute does not hide
    link_busy: float  # seconds the busiest link needs for all its traffic: a floor on the step
    model_flops_per_step: float
    gpus: int
    peak_flops: float

    @property
    def total(self) -> float:
        return max(self.compute + self.bubble + sum(self.exposed.values()), self.link_busy)

    @property
    def predicted_mfu(self) -> float:
        return self.model_flops_per_step / (self.total * self.gpus * self.peak_flops)

    def as_dict(self) -> dict[str, float]:
        return {
            "total": self.total,
            "compute": self.compute,
            "bubble": self.bubble,
            "exposed_comm": sum(self.exposed.values()),
            "link_busy": self.link_busy,
            **{f"exposed_{d}": self.exposed[d] for d in DIMENSIONS},
        }


def predict_step_time(est: Estimate, cluster: Cluster) -> StepTime:
    setup = est.setup
    gpus = setup.world_size
    compute = est.flops.hardware_per_step / gpus / (cluster.peak_flops * cluster.compute_efficiency)
    comm = {d: 0.0 for d in DIMENSIONS}
    busy = {link: 0.0 for link in Link}
    seconds = []
    for entry in est.comm:
        link = entry.link
        t = entry.bytes_per_rank / cluster.bandwidth(link) + entry.launches * cluster.latency(link)
        seconds.append(t)
        comm[entry.dim] += t
        busy[entry.link] += t
    forward = est.flops.model_per_token / 3  # the recomputed forward runs inside backward
    backward_share = 1 - forward / est.flops.hardware_per_token
    attention_share = est.flops.attention_per_token / est.flops.hardware_per_token
    exposed = {d: 0.0 for d in DIMENSIONS}
    exposed["dp"] = data_parallel_exposed(
        est.comm, seconds, setup.zero, setup.microbatches_per_step, compute, backward_share
    )
    # The ring's transfers run behind the block compute of attention; all-to-alls (Ulysses,
    # hybrid) and all-gathers block it: attention waits for their result.
    ring = sum(t for e, t in zip(est.comm, seconds) if e.dim == "cp" and e.collective is Collective.SEND_RECV)
    exposed["cp"] = (comm["cp"] - ring) + max(0.0, ring - compute * attention_share)
    for d in ("tp", "pp", "ep"):
        exposed[d] = comm[d]
    return StepTime(
        compute=compute,
        bubble=compute * est.bubble_relative,
        comm=comm,
        exposed=exposed,
        link_busy=max(busy.values()),
        model_flops_per_step=est.flops.model_per_step,
        gpus=gpus,
        peak_flops=cluster.peak_flops,
    )
