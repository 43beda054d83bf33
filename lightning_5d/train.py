"""``l5d train``: compose a recipe with Hydra, validate it, then start the workers.

The job never trains in the process Hydra runs it in (unless that process already is
one rank of a distributed job, e.g. a SLURM task): it checks the layout against the
world size first, so a bad layout fails with the config's own message before any
process starts, then writes the fully resolved config to ``<run dir>/resolved.yaml``
and starts ``devices`` workers on it with ``torch.distributed.run``
(:mod:`lightning_5d.launch`). Lightning's own launcher is not used because it
re-executes ``sys.argv``, which would re-run the Hydra app (and a whole multirun).

Configs live outside the package, next to it: ``conf/`` holds the config groups, and
``conf/recipe`` is a link to the top-level ``recipes/`` directory, which makes it the
``recipe`` group. Your own recipes: put them in ``<dir>/recipe/<name>.yaml`` and pass
``--config-dir <dir>``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from lightning_5d.launch import WorkersFailed

log = logging.getLogger(__name__)

RECIPE_GROUP = "recipe"
DRY_RUN_FLAG = "--dry-run"  # compose, validate and count each rank's start-up bytes; start nothing
RESOLVED_NAME = "resolved.yaml"
SUMMARY_NAME = "summary.json"


class ConfigError(ValueError):
    """A run config that cannot work, found before any worker starts."""


# --------------------------------------------------------------------------- configs


def project_root() -> Path:
    """The directory holding ``conf/`` and ``recipes/``.

    ``$L5D_HOME`` if set; else the source checkout the package was imported from;
    else ``<prefix>/share/lightning_5d`` (where a wheel would install them).
    """
    candidates = []
    if os.environ.get("L5D_HOME"):
        candidates.append(Path(os.environ["L5D_HOME"]))
    candidates.append(Path(__file__).resolve().parent.parent)
    candidates.append(Path(sys.prefix) / "share" / "lightning_5d")
    for root in candidates:
        if (root / "conf" / "config.yaml").is_file():
            return root
    raise ConfigError(
        "cannot find the l5d configs (conf/config.yaml); looked in "
        + ", ".join(str(c) for c in candidates)
        + ". Set L5D_HOME to the directory that holds conf/ and recipes/."
    )


def config_dir() -> Path:
    return project_root() / "conf"


def compose(overrides: Iterable[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """The job config ``l5d train <overrides>`` would run, without running it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="train"):
        return hydra_compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be a positive integer.")
    return value


def layout_combination(cfg: DictConfig, parallel, layout):
    """The layout-only rules' input from the composed config (precision options as l5d train passes them)."""
    from lightning_5d.layout_rules import Combination

    options = cfg.get("precision_options")
    options = OmegaConf.to_container(options, resolve=True) if options else {}
    fp8 = options.get("fp8") or {}
    pipe = parallel.pipeline
    return Combination(
        layout,
        zero=parallel.zero,
        sequence_parallel=parallel.sequence_parallel,
        schedule=pipe.schedule,
        virtual_stages=pipe.virtual_stages,
        microbatches=pipe.microbatches,
        fp32_accumulation=options.get("accumulation_dtype") == "fp32",
        loss_scaling=str(cfg.get("precision", "")) in ("16-mixed", "16"),
        fp8_all_gather=str(cfg.get("precision", "")).startswith("fp8") and bool(fp8.get("fp8_all_gather")),
    )


def validate(cfg: DictConfig, refuse_combinations: bool = True):
    """Resolve the parallel layout against ``devices * num_nodes``; raise on any problem.

    Runs in the Hydra job before anything is launched. Returns the
    :class:`~lightning_5d.config.Layout`. ``refuse_combinations=False`` leaves the
    ``layout_rules`` refusals to the caller (``l5d estimate --recipe`` lists them as problems).
    """
    from lightning_5d.config import ContextParallelMode, LayoutError, ParallelConfig
    from lightning_5d.layout_rules import refusal, validate_early

    devices = _positive_int(cfg, "devices")
    num_nodes = _positive_int(cfg, "num_nodes")
    parallel = ParallelConfig.from_mapping(OmegaConf.to_container(cfg.parallel, resolve=True))
    validate_early(parallel)
    layout = parallel.resolve(devices * num_nodes)
    if "model" in cfg:
        from lightning_5d.models import LlamaConfig

        try:
            model_config = LlamaConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model: {err}") from None
        if layout.tp > 1:
            _check_tensor_parallel(model_config, parallel, layout.tp)
        _check_experts(model_config, layout, parallel.expert)
        if layout.cp > 1 and parallel.context.mode is ContextParallelMode.HYBRID:
            from lightning_5d.parallel.context.hybrid import check_hybrid

            kv = model_config.num_kv_heads or model_config.num_heads
            check_hybrid(layout.cp, parallel.context.ulysses, (model_config.num_heads // layout.tp, kv // layout.tp))
    # The strategy refuses these at setup too (same rules); here they fail before any worker starts.
    refused = refusal(layout_combination(cfg, parallel, layout)) if refuse_combinations else None
    if refused is not None:
        raise LayoutError(f"parallel: {refused[1]}")
    if layout.pp > 1:
        _check_pipeline(cfg, parallel, layout.pp)
    if layout.cp > 1 and "data" in cfg and "seq_len" in cfg.data:
        from lightning_5d.parallel.context.batch import check_sequence_length

        check_sequence_length(_positive_int(cfg.data, "seq_len"), layout.cp, parallel.context.sharding)
    if "precision" in cfg:
        from lightning_5d.precision import precision_plugins

        options = cfg.get("precision_options")
        try:  # builds the plugin, so a bad recipe or option fails here, not in every worker
            precision_plugins(cfg.precision, OmegaConf.to_container(options, resolve=True) if options else None)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"precision: {err}") from None
    _check_requeue(cfg)
    _check_checkpoint(cfg)
    mode = cfg.launcher.mode
    if mode not in ("auto", "torchrun", "inprocess"):
        raise ConfigError(f"launcher.mode={mode!r} must be one of 'auto', 'torchrun', 'inprocess'.")
    return layout


def _check_checkpoint(cfg: DictConfig) -> None:
    """The ``checkpoint:`` keys, before any process starts."""
    from lightning_5d.checkpoint.options import checked_options
    from lightning_5d.config import StrategyOptions
    from lightning_5d.worker import checkpoint_options

    section = OmegaConf.to_container(cfg.checkpoint, resolve=True) if "checkpoint" in cfg else None
    try:
        options = checkpoint_options(section or {})
        typed = StrategyOptions(**options)  # types and ranges, as FiveDStrategy checks them
        checked_options(typed.checkpoint_format, typed.checkpoint_write, typed.keep_last_k)  # async needs sharded
    except ValueError as err:
        raise ConfigError(f"checkpoint: {err}") from None
    pretrained = options.get("pretrained")
    if pretrained is not None and not Path(pretrained).exists():
        raise ConfigError(
            f"checkpoint.pretrained={pretrained!r} does not exist; pass a .safetensors/.pt file or a folder."
        )


def _check_requeue(cfg: DictConfig) -> None:
    """The ``requeue:`` and ``resume:`` keys, here rather than in every worker."""
    from hydra.core.hydra_config import HydraConfig

    from lightning_5d.requeue import RequeueConfigError, validate_job

    # The default requeue.dirpath names ${hydra:...} values, which exist only inside a Hydra
    # job; a config from compose() alone is checked with them unresolved.
    resolve = HydraConfig.initialized()
    keys: dict[str, Any] = {}
    for key in ("requeue", "resume"):
        if key in cfg:
            value = cfg[key]
            keys[key] = OmegaConf.to_container(value, resolve=resolve) if OmegaConf.is_config(value) else value
    try:
        validate_job(keys)
    except RequeueConfigError as err:
        raise ConfigError(str(err)) from None


def _check_pipeline(cfg: DictConfig, parallel: Any, pp: int) -> None:
    """Blocks per stage and microbatches per batch, here rather than after every rank started."""
    from lightning_5d.parallel.pipeline.batch import PipelineError
    from lightning_5d.pipeline_shape import check_stage_count, default_microbatches

    v = parallel.pipeline.virtual_stages
    m = parallel.pipeline.microbatches or default_microbatches(pp, v)
    if "model" in cfg and "num_layers" in cfg.model:
        check_stage_count(_positive_int(cfg.model, "num_layers"), pp, v)
    if "data" in cfg and "batch_size" in cfg.data:
        batch = _positive_int(cfg.data, "batch_size")
        if batch % m:
            raise PipelineError(
                f"data.batch_size={batch} does not split into pipeline.microbatches={m}; set data.batch_size to a "
                f"multiple of {m} (e.g. {m * max(1, round(batch / m))}) or microbatches to a divisor of {batch}."
            )


def _check_experts(model_config: Any, layout: Any, expert: Any) -> None:
    """ep > 1 needs MoE layers whose experts split evenly over the ep ranks; a capacity or load
    balancing (which run the expert dispatch at ep=1 too) needs MoE layers as well."""
    from lightning_5d.config import LayoutError, LoadBalancing

    ep, experts = layout.ep, model_config.num_experts or 0
    routed = expert.capacity_factor is not None or expert.load_balancing != LoadBalancing.NONE
    if experts <= 0 and ep > 1:
        raise LayoutError(
            f"parallel.ep={ep} but the model has no experts (model.num_experts={experts}): expert parallelism "
            f"splits the experts of MoE layers. Set model.num_experts to a multiple of {ep} (e.g. model=tiny_moe, "
            f"4 experts), or set parallel.ep=1."
        )
    if experts <= 0 and routed:
        asked = [f"load_balancing={expert.load_balancing.value}"] * (expert.load_balancing != LoadBalancing.NONE)
        asked += [f"capacity_factor={expert.capacity_factor}"] * (expert.capacity_factor is not None)
        raise LayoutError(
            f"parallel.expert.{' and '.join(asked)}: load balancing and capacity act on MoE layers, but the model "
            f"has no experts (model.num_experts={experts}). Set model.num_experts (e.g. model=tiny_moe), or "
            f"parallel.expert.load_balancing=none and parallel.expert.capacity_factor=null."
        )
    if ep > 1 and experts % ep:
        borrow = layout.dp_shard * layout.cp
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and borrow % d == 0]
        raise LayoutError(
            f"model.num_experts={experts} does not split over parallel.ep={ep} (each ep rank holds "
            f"num_experts/ep experts); valid ep values here (divisors of {experts} that also divide "
            f"dp_shard*cp={borrow}): {fits}."
        )


def _check_tensor_parallel(model_config: Any, parallel: Any, tp: int) -> None:
    """Map the model and check its shapes against tp here, not after every rank started."""
    import torch

    from lightning_5d.models import LlamaModel
    from lightning_5d.parallel.tensor.validate import validate_tensor_parallel
    from lightning_5d.plan import discover

    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = LlamaModel(model_config)
    validate_tensor_parallel(discover(model, parallel.model_plan), model, tp)


# --------------------------------------------------------------------------- the job


def job_config(cfg: DictConfig, layout: Any) -> dict:
    """The resolved job config as plain containers, plus an ``l5d`` section saying where it came from."""
    from hydra.core.hydra_config import HydraConfig

    job = OmegaConf.to_container(cfg, resolve=True)
    meta: dict[str, Any] = {"layout": layout.describe()}
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        meta["choices"] = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/")}
        meta["overrides"] = list(hc.overrides.task)
    job["l5d"] = meta
    return job


def write_resolved(job: dict, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESOLVED_NAME
    header = "# Written by `l5d train`; the workers (lightning_5d/worker.py) read it.\n"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(header + OmegaConf.to_yaml(OmegaConf.create(job)), encoding="utf-8")
    tmp.replace(path)
    return path


def launch_mode(cfg: DictConfig) -> str:
    """``"inprocess"`` or ``"torchrun"`` for this job; raises :class:`ConfigError` if neither fits."""
    from lightning_5d import launch

    env = launch.distributed_env()
    mode = cfg.launcher.mode
    if mode == "auto":
        mode = "inprocess" if env is not None else "torchrun"
    world = cfg.devices * cfg.num_nodes
    if mode == "inprocess":
        env_world = launch.env_world_size()
        if env_world != world:
            raise ConfigError(
                f"this process is one of {env_world} ranks ({env or 'no distributed environment'}), "
                f"but devices * num_nodes = {cfg.devices} * {cfg.num_nodes} = {world}; "
                f"set them so that the product is {env_world}."
            )
    elif cfg.num_nodes != 1:
        raise ConfigError(
            f"num_nodes={cfg.num_nodes}: `l5d train` starts workers on this node only. Use "
            "`-m hydra/launcher=slurm`, or start `l5d train` on every node under srun/torchrun "
            "(launcher.mode=auto then runs each rank in-process)."
        )
    return mode


def _requeue_signals(requeue: Any) -> list[str]:
    from lightning_5d.requeue import DEFAULT_SIGNALS, parse_signals

    return [s.name for s in parse_signals(requeue.get("signals", DEFAULT_SIGNALS))]


def run_job(cfg: DictConfig) -> Optional[dict]:
    """The Hydra task: validate, write ``resolved.yaml``, run the workers, return the summary."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_5d import launch
    from lightning_5d.config import LayoutError

    try:
        layout = validate(cfg)
        mode = launch_mode(cfg)
    except (LayoutError, ConfigError) as err:
        if HydraConfig.get().mode == RunMode.RUN:
            # One job: the message alone, exit code 2, nothing started. In a sweep the
            # exception fails only this job; Hydra runs the rest and exits 1 at the end.
            print(f"l5d train: invalid config: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        log.error("invalid config: %s", err)
        raise
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info("layout %s; %s; output in %s", layout.describe(), mode, run_dir)
    job = job_config(cfg, layout)

    if mode == "inprocess":
        if launch.env_rank() == 0:
            write_resolved(job, run_dir)
        from lightning_5d.worker import run

        return run(job, run_dir)

    resolved = write_resolved(job, run_dir)
    requeue = job.get("requeue") or {}
    rc = launch.torchrun(
        resolved,
        nproc=cfg.devices,
        timeout_s=cfg.launcher.timeout_s,
        master_port=cfg.launcher.master_port,
        log_file=run_dir / "workers.log",
        catch=_requeue_signals(requeue) if requeue.get("enabled") else (),
    )
    if rc != 0:
        raise WorkersFailed(f"workers exited with code {rc}; their output is in {run_dir / 'workers.log'}")
    summary = run_dir / SUMMARY_NAME
    if not summary.is_file():
        raise WorkersFailed(f"workers finished but wrote no {summary}")
    return json.loads(summary.read_text())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the Hydra app on ``argv`` (Hydra overrides and flags, e.g. ``-m``, ``--cfg job``)."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    if DRY_RUN_FLAG in argv:
        from lightning_5d.dryrun.recipe import main as dry_run_main

        return dry_run_main([a for a in argv if a != DRY_RUN_FLAG])
    try:
        conf = config_dir()
    except ConfigError as err:
        print(f"l5d train: {err}", file=sys.stderr)
        return 2
    app = hydra.main(version_base="1.3", config_path=str(conf), config_name="config")(run_job)
    saved = sys.argv
    # Hydra parses sys.argv; argv[0] only names the program in its usage text.
    sys.argv = ["l5d train", *argv]
    try:
        app()
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
