"""One rank of an ``l5d train`` job: model, data and Trainer from the resolved config; fit.

Started by ``torch.distributed.run`` as ``python lightning_5d/worker_boot.py [--catch
SIGNALS] <run dir>/resolved.yaml``, which records the requeue signals before any import and
then calls :func:`main` (``python -m lightning_5d.worker <resolved.yaml>`` works too, without
that); Lightning detects torchelastic and launches nothing. Or called in-process through
:func:`run` when the job already is one rank of a SLURM or torchrun job. Everything it needs is in the resolved config; its outputs go to the
directory that holds it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence


def layout_text(layout: Any) -> str:
    """``dp_replicate:2,dp_shard:2``: the dims larger than 1, outermost first."""
    sizes = [(d, getattr(layout, d)) for d in layout.rank_order] + [("ep", layout.ep)]
    parts = [f"{d}:{v}" for d, v in sizes if v > 1]
    return ",".join(parts) or "single"


def run(cfg: Mapping[str, Any], run_dir: str | Path, early: Any = None) -> Optional[dict]:
    """Train this rank on ``cfg`` (the resolved config as plain containers); ``early``: the
    signals worker_boot.py caught before the imports."""
    import lightning as L
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from lightning_5d.config import ParallelConfig
    from lightning_5d.console import quiet_third_party_notices
    from lightning_5d.models import LlamaLM, TextDataModule
    from lightning_5d.precision import precision_plugins
    from lightning_5d.report import RunReport
    from lightning_5d.strategy import FiveDStrategy

    run_dir = Path(run_dir)
    devices, num_nodes = int(cfg["devices"]), int(cfg["num_nodes"])
    parallel = ParallelConfig.from_mapping(cfg["parallel"])
    layout = parallel.resolve(devices * num_nodes)  # the job checked this; cheap to repeat

    strategy = FiveDStrategy.from_config(parallel, **checkpoint_options(cfg.get("checkpoint") or {}))
    L.seed_everything(cfg["seed"], workers=True, verbose=False)  # same initial weights on every rank
    optim = dict(cfg.get("optim") or {})
    if "betas" in optim:
        optim["betas"] = tuple(optim["betas"])
    # On the meta device: no rank ever holds the whole model; setup materializes each rank's
    # pieces with the values this build would have had in one process.
    with strategy.tensor_init_context(empty_init=True):
        model = LlamaLM(dict(cfg["model"]), **optim)
    data = TextDataModule(**cfg["data"])

    trainer_kwargs = dict(cfg["trainer"])
    log_every = trainer_kwargs.pop("log_every", 10)
    accumulate = int(trainer_kwargs.get("accumulate_grad_batches") or 1)
    meta = cfg.get("l5d") or {}
    choices = meta.get("choices") or {}
    report = RunReport(
        log_every=log_every,
        run_dir=run_dir,
        # Every data-parallel rank reads its own batch of full sequences per micro-batch.
        tokens_per_step=data.batch_size * data.seq_len * layout.dp * accumulate,
        info={
            "recipe": choices.get("recipe"),
            "layout": layout_text(layout),
            "sizes": {**layout.sizes(), "ep": layout.ep},
            "zero": int(parallel.zero),
            "precision": cfg["precision"],
            "run_dir": str(run_dir),
        },
    )
    precision, plugins = precision_plugins(cfg["precision"], cfg.get("precision_options"))
    if TorchElasticEnvironment.detect():
        # Explicit, so that torchrun inside a one-task SLURM allocation is not taken for srun.
        plugins.append(TorchElasticEnvironment())
    # Sequences come from an in-memory tensor; worker processes would only add startup time.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    quiet_third_party_notices()

    from lightning_5d.requeue import job_setup

    requeue = job_setup(cfg, plugins, early)
    plugins.extend(requeue.plugins)
    trainer = L.Trainer(
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        default_root_dir=str(run_dir),
        enable_progress_bar=False,
        callbacks=[report, *requeue.callbacks, checkpoint_notice()],
        plugins=plugins,
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=data, ckpt_path=requeue.ckpt_path)
    requeue.after_fit()
    summary = run_dir / "summary.json"
    if trainer.global_rank == 0 and summary.is_file():
        import json

        return json.loads(summary.read_text())
    return None


def checkpoint_notice() -> Any:
    """A callback that says, once fit has set up, where this run's checkpoints go and how to export them."""
    import lightning as L
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    class CheckpointNotice(L.Callback):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            # ModelCheckpoint learns its folder in setup (<run dir>/checkpoints without a logger).
            for callback in trainer.checkpoint_callbacks:
                folder = getattr(callback, "dirpath", None)
                if folder:
                    rank_zero_info(
                        f"[lightning_5d] checkpoints: {folder} (`latest` names the newest); to a Hugging Face "
                        f"folder or .safetensors: l5d export {folder} <out>"
                    )
            for callback in trainer.callbacks:
                if type(callback).__name__ == "AutoRequeue":
                    rank_zero_info(f"[lightning_5d] requeue checkpoints: {callback.dirpath}")

    return CheckpointNotice()


def checkpoint_options(section: Mapping[str, Any]) -> dict[str, Any]:
    """conf's ``checkpoint:`` section -> FiveDStrategy keyword arguments."""
    names = {"format": "checkpoint_format", "write": "checkpoint_write", "keep_last_k": "keep_last_k",
             "pretrained": "pretrained", "pretrained_prefix": "pretrained_prefix"}  # fmt: skip
    unknown = sorted(set(section) - set(names))
    if unknown:
        raise ValueError(f"unknown checkpoint option(s) {unknown}; valid: {sorted(names)}")
    return {names[k]: v for k, v in section.items() if v is not None}


def main(argv: Optional[Sequence[str]] = None, early: Any = None) -> int:
    from omegaconf import OmegaConf

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m lightning_5d.worker <run dir>/resolved.yaml", file=sys.stderr)
        return 2
    path = Path(argv[0]).resolve()
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    run(cfg, path.parent, early)
    return 0


if __name__ == "__main__":
    sys.exit(main())

