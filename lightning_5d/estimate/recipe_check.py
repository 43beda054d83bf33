"""The planner's verdict on an ``l5d train`` recipe: its exact layout, without building the model.

    from lightning_5d.train import compose
    from lightning_5d.estimate.recipe_check import check_recipe
    check = check_recipe(compose(["recipe=llama3_70b_64gpu"]))
    check.fits, check.memory_gib, check.predicted_mfu, check.tokens_per_second
    print(check.format())

or ``l5d estimate --recipe llama3_70b_64gpu [hydra overrides...]``.

The composed config goes through :func:`lightning_5d.train.validate` first (the checks ``l5d
train`` runs before it launches anything), then each key the workers read becomes a planner
input:

==========================================  ==========================================
config                                      planner (``TrainingSetup``, ``Cluster``)
==========================================  ==========================================
``model.*``                                 ``ModelSpec`` (same field names)
``devices * num_nodes``, ``parallel.*``     the resolved layout; ``zero``; ``sequence_parallel``
``parallel.pipeline.*``                     ``schedule``, ``virtual_stages``, ``microbatches``
``data.batch_size`` (per data rank)         ``micro_batch_size`` = batch_size / microbatches with pp
``trainer.accumulate_grad_batches``         ``grad_accum``
``data.seq_len``                            ``seq_len``
``parallel.activation_checkpointing``       ``recompute``
``precision``, ``precision_options``        ``precision`` (bf16 / fp8 / fp32), fp32 accumulation
``devices``                                 ``gpus_per_node``
``cluster.*`` (optional, the recipe's)      GPU memory, peak FLOP/s, bandwidths, efficiency
==========================================  ==========================================

Attention is counted as the flash kernel (the reference model calls SDPA, which keeps no
``s x s`` scores). Where the planner's model and what the runtime does differ, the check says
so in ``notes`` (modelled approximately) or ``problems`` (the runtime would refuse or the
planner's numbers would be wrong); see :func:`check_recipe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_5d.config import ParallelConfig, PipelineSchedule
from lightning_5d.layout_rules import refusal

from .estimator import Estimate, estimate
from .flops import training_flops
from .params import count_params
from .spec import ModelSpec, spec_from_config_object
from .timing import DEFAULT_PEAK_TFLOPS, GIB, Cluster, StepTime, predict_step_time
from .training import Precision, TrainingSetup

# The optional `cluster:` section of a recipe -> Cluster fields (GB/s and TFLOP/s as `l5d plan` takes them).
CLUSTER_KEYS = {
    "gpu": None,  # a label, e.g. "H100 SXM 80GB"
    "gpu_memory_gib": ("gpu_memory_gib", 1.0),
    "peak_tflops": ("peak_flops", 1e12),
    "intra_node_bandwidth_gbs": ("intra_node_bandwidth", 1e9),
    "inter_node_bandwidth_gbs": ("inter_node_bandwidth", 1e9),
    "compute_efficiency": ("compute_efficiency", 1.0),
    "memory_headroom": ("memory_headroom", 1.0),
}


class RecipeCheckError(ValueError):
    """A recipe the planner cannot read (the message names the key)."""


@dataclass(frozen=True)
class RecipeCheck:
    """The planner's prediction for one composed recipe.

    ``estimate`` is for the layout as the planner models it: when the runtime's pipeline stages
    hold unequal numbers of blocks (pp*v does not divide the layers, or ``pipeline.balance``
    says so), with ``modelled_layers`` = every stage holding the most loaded stage's blocks;
    ``predicted_mfu`` then counts the FLOPs of the real model (``spec``).
    """

    recipe: str | None
    spec: ModelSpec  # the recipe's model
    setup: TrainingSetup
    cluster: Cluster
    estimate: Estimate
    time: StepTime
    model_flops_per_step: float  # of ``spec``: what MFU divides by
    modelled_layers: int
    notes: tuple[str, ...]  # where the planner's model is approximate
    problems: tuple[str, ...]  # where the runtime refuses the recipe or the numbers do not hold

    @property
    def world_size(self) -> int:
        return self.setup.world_size

    @property
    def memory_bytes(self) -> float:
        """Predicted peak bytes on the most loaded GPU."""
        return self.estimate.memory.total

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def usable_gib(self) -> float:
        return self.cluster.usable_memory_bytes / GIB

    @property
    def fits(self) -> bool:
        """Within the GPU memory less the cluster's headroom (10 % by default), as `l5d plan` judges."""
        return self.memory_bytes <= self.cluster.usable_memory_bytes

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_second(self) -> float:
        return self.setup.tokens_per_step / self.time.total

    @property
    def predicted_mfu(self) -> float:
        """Model FLOPs of the recipe's model / (step time x GPUs x peak)."""
        return self.model_flops_per_step / (self.time.total * self.world_size * self.cluster.peak_flops)

    @property
    def bubble_fraction(self) -> float:
        return self.estimate.bubble_fraction

    def summary(self) -> str:
        """One line: recipe, layout, memory vs usable, MFU, tokens/s, bubble."""
        return (
            f"{self.recipe or self.spec.name}: {self.world_size} GPUs, {self.setup.describe()}: "
            f"{self.memory_gib:.1f} of {self.usable_gib:.1f} GiB usable ({'fits' if self.fits else 'does NOT fit'}), "
            f"predicted MFU {100 * self.predicted_mfu:.1f}%, {self.tokens_per_second:,.0f} tokens/s, "
            f"step {self.step_time_s:.2f} s, bubble {100 * self.bubble_fraction:.1f}%"
        )

    def format(self) -> str:
        """The `l5d estimate` table for the modelled layout, then the verdict."""
        from .report import format_estimate

        mem = self.cluster.gpu_memory_gib
        lines = [f"recipe      {self.recipe}" if self.recipe else ""]
        if self.modelled_layers != self.spec.num_layers:
            counts = count_params(self.spec)
            lines.append(
                f"recipe's    {self.spec.name}: {counts.total / 1e9:.2f}B params, {self.spec.num_layers} layers; "
                f"modelled below with {self.modelled_layers} (see the note)"
            )
        lines.append(format_estimate(self.estimate))
        lines.append(
            f"cluster     {self.world_size} GPUs, {self.cluster.gpus_per_node} per node, {mem:g} GiB each "
            f"({self.usable_gib:.1f} usable), peak {self.cluster.peak_flops / 1e12:g} TFLOP/s, "
            f"efficiency {self.cluster.compute_efficiency:g}"
        )
        lines.append(f"verdict     {self.summary()}")
        lines += [f"note        {n}" for n in self.notes]
        lines += [f"PROBLEM     {p}" for p in self.problems]
        return "\n".join(line for line in lines if line)

    def to_dict(self) -> dict[str, Any]:
        """The ``l5d estimate --json`` keys for the modelled layout, plus the recipe's verdict."""
        counts = count_params(self.spec)
        return {
            **self.estimate.to_dict(),
            "recipe": self.recipe,
            "model_params": counts.total,
            "model_params_active": counts.active,
            "model_layers": self.spec.num_layers,
            "modelled_layers": self.modelled_layers,
            "model_flops_per_step": self.model_flops_per_step,
            "gpu_memory_gib": self.cluster.gpu_memory_gib,
            "usable_memory_gib": self.usable_gib,
            "peak_flops_per_gpu": self.cluster.peak_flops,
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "time_breakdown_s": self.time.as_dict(),
            "tokens_per_second": self.tokens_per_second,
            "predicted_mfu": self.predicted_mfu,
            "notes": list(self.notes),
            "problems": list(self.problems),
        }


def _plain(section: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    if section is None:
        return {}
    if OmegaConf.is_config(section):
        return OmegaConf.to_container(section, resolve=True)
    return dict(section)


def _precision(text: str) -> Precision:
    text = str(text).lower()
    if text == "fp8" or text.startswith("fp8-"):
        return Precision.FP8
    if text in ("32", "32-true", "fp32"):
        return Precision.FP32
    if text in ("bf16-mixed", "bf16-true", "bf16", "16-mixed"):
        return Precision.BF16
    raise RecipeCheckError(f"precision={text!r}: the planner models bf16-mixed, fp8-<recipe> and 32-true.")


def cluster_for(cfg: Any, **overrides: Any) -> Cluster:
    """The hardware a recipe targets: ``devices`` GPUs per node, its ``cluster:`` section, then ``overrides``
    (``Cluster`` field names). Peak FLOP/s defaults to an H100's for the recipe's precision."""
    fields: dict[str, Any] = {}
    for key, value in _plain(cfg.get("cluster")).items():
        if key not in CLUSTER_KEYS:
            raise RecipeCheckError(f"cluster.{key} is not a planner input; known keys: {sorted(CLUSTER_KEYS)}.")
        if CLUSTER_KEYS[key] is not None and value is not None:
            name, scale = CLUSTER_KEYS[key]
            fields[name] = float(value) * scale
    fields.setdefault("peak_flops", DEFAULT_PEAK_TFLOPS[_precision(cfg.precision)] * 1e12)
    fields.update(overrides)
    return Cluster(gpus=int(cfg.devices) * int(cfg.num_nodes), gpus_per_node=int(cfg.devices), **fields)


def spec_from_recipe(cfg: Any, name: str | None = None) -> ModelSpec:
    """The ``model:`` section (``lightning_5d.models.LlamaConfig`` fields) as a planner ``ModelSpec``."""
    from lightning_5d.models import LlamaConfig

    try:
        config = LlamaConfig(**_plain(cfg.model))
    except (TypeError, ValueError) as err:
        raise RecipeCheckError(f"model: {err}") from None
    return spec_from_config_object(config, name=name or "model")


def setup_from_recipe(cfg: Any, layout: Any = None) -> TrainingSetup:
    """The composed config's layout, batch shape and modes as a planner ``TrainingSetup``."""
    from lightning_5d.config import ParallelConfig
    from lightning_5d.pipeline_shape import default_microbatches

    parallel = ParallelConfig.from_mapping(_plain(cfg.parallel))
    if layout is None:
        layout = parallel.resolve(int(cfg.devices) * int(cfg.num_nodes))
    data, trainer = _plain(cfg.get("data")), _plain(cfg.get("trainer"))
    batch = int(data.get("batch_size", 1))
    v = parallel.pipeline.virtual_stages
    m = (parallel.pipeline.microbatches or default_microbatches(layout.pp, v)) if layout.pp > 1 else 1
    if batch % m:
        raise RecipeCheckError(f"data.batch_size={batch} does not split into pipeline.microbatches={m}.")
    options = _plain(cfg.get("precision_options"))
    return TrainingSetup(
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        cp=layout.cp,
        cp_mode=parallel.context.mode,
        cp_ulysses=parallel.context.ulysses,
        pp=layout.pp,
        ep=layout.ep,
        zero=parallel.zero,
        sequence_parallel=parallel.sequence_parallel,
        schedule=parallel.pipeline.schedule,
        microbatches=m if layout.pp > 1 else None,
        virtual_stages=v,
        recompute=parallel.activation_checkpointing,
        precision=_precision(cfg.precision),
        fp32_grad_accumulation=options.get("accumulation_dtype") == "fp32",
        micro_batch_size=batch // m,
        seq_len=int(data.get("seq_len", 1)),
        grad_accum=int(trainer.get("accumulate_grad_batches") or 1),
        rank_order=tuple(parallel.rank_order),
    )


def runtime_stage_blocks(spec: ModelSpec, cfg: Any, stages: int) -> list[int]:
    """Blocks per pipeline stage as the runtime cuts them (``parallel.pipeline.balance`` / ``stage_blocks``)."""
    from lightning_5d.config import ParallelConfig
    from lightning_5d.parallel.pipeline.split import split_blocks, stage_weights

    pipeline = ParallelConfig.from_mapping(_plain(cfg.parallel)).pipeline
    counts = count_params(spec)
    weights = stage_weights([counts.layer.total] * spec.num_layers, counts.head, pipeline.balance)
    return [len(r) for r in split_blocks(weights, stages, pipeline.stage_blocks)]


def _choice(cfg: Any, group: str) -> str | None:
    """Which option of a config group was composed (only with ``compose(..., return_hydra_config=True)``)."""
    try:
        return str(cfg.hydra.runtime.choices[group])
    except Exception:
        return None


def check_recipe(cfg: Any, recipe: str | None = None, validate: bool = True, **cluster_overrides: Any) -> RecipeCheck:
    """Predict memory per GPU, step time, MFU and bubble for a composed ``l5d train`` config.

    ``validate``: run :func:`lightning_5d.train.validate` first (it raises on a layout ``l5d
    train`` would refuse). ``cluster_overrides``: ``Cluster`` fields over the recipe's own
    ``cluster:`` section (e.g. ``gpu_memory_gib=141`` for an H200).
    """
    layout = None
    if validate:
        from lightning_5d.train import validate as validate_job

        layout = validate_job(cfg, refuse_combinations=False)
    recipe = recipe or _choice(cfg, "recipe")
    spec = spec_from_recipe(cfg, name=_choice(cfg, "model") or (recipe and f"{recipe}.model"))
    setup = setup_from_recipe(cfg, layout)
    cluster = cluster_for(cfg, **cluster_overrides)
    notes: list[str] = ["attention as the flash kernel (SDPA): no s x s scores kept"]
    problems: list[str] = []

    stages = setup.pp * setup.v
    modelled = spec
    if setup.pp > 1:
        blocks = runtime_stage_blocks(spec, cfg, stages)
        if max(blocks) * stages != spec.num_layers:
            modelled = spec.replace(num_layers=max(blocks) * stages)
            notes.append(
                f"the runtime cuts the {spec.num_layers} blocks into {stages} stages of {min(blocks)}..{max(blocks)} "
                f"(pipeline.balance / stage_blocks); modelled as {modelled.num_layers} layers, every stage with the "
                f"most loaded stage's {max(blocks)}, so memory is an upper bound and the step is the slowest "
                f"stage's; MFU counts the real {spec.num_layers} layers' FLOPs"
            )
    from lightning_5d.train import layout_combination

    parallel = ParallelConfig.from_mapping(_plain(cfg.parallel))
    refused = refusal(layout_combination(cfg, parallel, layout or setup.layout))
    if refused is not None:  # the rules FiveDStrategy raises from (lightning_5d.layout_rules)
        problems.append(f"the runtime refuses this layout: {refused[1]}")
    if spec.is_moe:
        notes.append("MoE: even expert load assumed (no routing imbalance, no dropped tokens), aux loss not counted")
        if setup.tp > 1:
            problems.append(
                f"tp={setup.tp} with MoE: the planner splits experts ep*tp ways, the runtime replicates them over tp "
                f"(no expert-tensor parallelism yet), so the expert memory is under-counted {setup.tp}x"
            )
    startup = 4 * count_params(spec).total  # fp32, as nn.Module builds it
    if startup > cluster.usable_memory_bytes:
        notes.append(
            f"start-up: the whole model ({startup / GIB:.0f} GiB in fp32) is never built; the worker builds it on the "
            f"meta device and each rank materializes only its pieces. `l5d train recipe={recipe or '<name>'} "
            f"--dry-run` counts each rank's start-up bytes"
        )
    if setup.schedule in (PipelineSchedule.ZERO_BUBBLE, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV):
        notes.append(f"{setup.schedule.value} bubble assumes equal F, B and W times")

    est = estimate(modelled, setup, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node)
    time = predict_step_time(est, cluster)
    model_flops = training_flops(spec, setup).model_per_step
    return RecipeCheck(
        recipe=recipe,
        spec=spec,
        setup=setup,
        cluster=cluster,
        estimate=est,
        time=time,
        model_flops_per_step=model_flops,
        modelled_layers=modelled.num_layers,
        notes=tuple(notes),
        problems=tuple(problems),
    )


def check_recipe_name(name: str, overrides: tuple[str, ...] | list[str] = (), **cluster_overrides: Any) -> RecipeCheck:
    """Compose ``recipe=<name>`` (plus Hydra ``overrides``) as ``l5d train`` would, then :func:`check_recipe`."""
    from lightning_5d.train import compose

    cfg = compose([f"recipe={name}", *overrides], return_hydra_config=True)
    return check_recipe(cfg, recipe=name, **cluster_overrides)
