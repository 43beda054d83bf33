"""One multi-process training run of the reference model under FiveDStrategy.

Started by the tests under torch.distributed.run (Lightning detects torchelastic and does
not re-launch). Rank 0 writes the per-micro-batch losses (averaged over data ranks), the
final full parameters, and each rank's model-state bytes measured before the 2nd step.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
import torch.distributed as dist

import lightning_5d
from lightning_5d.accounting import SavedActivationMeter, model_state_bytes
from tests_support import MODELS, ConfiguredLM, RecordingLM, make_datamodule, unfreeze_matching

parser = argparse.ArgumentParser()
parser.add_argument("--zero", default="1", help="0-3, or 'auto': Trainer(strategy='5d'), the planner's layout")
parser.add_argument("--dp-replicate", type=int, default=1)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
parser.add_argument("--cp", type=int, default=1)
parser.add_argument("--cp-mode", default="ring", choices=["ring", "allgather", "alltoall", "hybrid"])
parser.add_argument("--cp-ulysses", type=int, default=None, help="cp ranks per all-to-all group (--cp-mode hybrid)")
parser.add_argument("--cp-sharding", default="zigzag", choices=["zigzag", "contiguous"])
parser.add_argument("--pp", type=int, default=1)
parser.add_argument("--ep", type=int, default=1)
parser.add_argument("--capacity-factor", type=float, default=None)
parser.add_argument("--balancing", default="none", choices=["none", "aux_loss", "bias"])
parser.add_argument("--batch-size", type=int, default=None)
parser.add_argument("--val-batches", type=int, default=0, help="validation batches per epoch (and sanity check)")
parser.add_argument("--schedule", default="1f1b")
parser.add_argument("--microbatches", type=int, default=None)
parser.add_argument("--virtual-stages", type=int, default=1)
parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--ac", default="none")
parser.add_argument("--precision", default="32-true", help="a Lightning precision, or fp8-<recipe> (FiveDPrecision)")
parser.add_argument("--fp8-all-gather", action="store_true")
parser.add_argument("--numerics-every", type=int, default=0)
parser.add_argument("--reduce-dtype", default="fp32")
parser.add_argument("--accumulation-dtype", default="bf16")
parser.add_argument("--num-samples", type=int, default=None)
parser.add_argument("--max-epochs", type=int, default=None, help="train whole epochs instead of --steps")
parser.add_argument("--save", action="store_true", help="ModelCheckpoint: epoch=N.ckpt in --out at each epoch end")
parser.add_argument("--save-every", type=int, default=0, help="ModelCheckpoint: step=N.ckpt every N steps")
parser.add_argument("--checkpoint-format", default="sharded", choices=["sharded", "full"])
parser.add_argument("--checkpoint-write", default="sync", choices=["sync", "async"])
parser.add_argument("--keep-last-k", type=int, default=None)
parser.add_argument("--kill-during-save", type=int, default=0, help="SIGKILL the last rank mid-write at this step")
parser.add_argument("--resume", default=None, help="checkpoint to resume from (Trainer.fit ckpt_path)")
parser.add_argument(
    "--build",
    default="eager",
    choices=["eager", "meta", "configure"],
    help="eager: in __init__; meta: under trainer.init_module(empty_init=True); configure: in configure_model",
)
parser.add_argument("--verify", default="auto", choices=["auto", "blocks", "off"])
parser.add_argument("--chunk-bytes", type=int, default=None,
                    help="meta builds: recompute tensors above this many bytes in row chunks of this size")
parser.add_argument("--pretrained", default=None, help="FiveDStrategy(pretrained=...); loaded.pt: the state it loaded")
parser.add_argument("--freeze", default=None,
                    help="a regex: parameters whose names match it are frozen (requires_grad_(False)) where the model is built")
parser.add_argument("--unfreeze-at", type=int, default=None,
                    help="with --freeze: make the frozen parameters trainable again before this step (a fine-tuning "
                         "schedule's unfreezing, as Lightning's BackboneFinetuning does)")
parser.add_argument("--optimizer-groups", default=None, choices=["decay"],
                    help="configure_optimizers' parameter groups (tests_support.decay_groups)")
parser.add_argument("--warmup-steps", type=int, default=0, help="LlamaLM's linear warm-up (LambdaLR, per step)")
parser.add_argument("--model-plan", default=None, help="FiveDStrategy(model_plan=...), as JSON")
parser.add_argument("--out", required=True)


class RecordLoaded(L.Callback):
    """The full model state before the first step (what pretrained= loaded), written by rank 0."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        state = trainer.strategy.full_model_state()  # a collective: every rank
        if dist.get_rank() == 0:
            torch.save({k: v.detach().clone() for k, v in state.items()}, self.out / "loaded.pt")


class Unfreeze(L.Callback):
    """Before step ``step``, the parameters ``pattern`` froze take gradients again."""

    def __init__(self, pattern: str, step: int):
        self.pattern, self.step = pattern, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            unfreeze_matching(pl_module, self.pattern)


class MeasureModelState(L.Callback):
    def __init__(self):
        self.bytes = None
        self.activations = None
        self._meter = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:  # the first micro-batch's forward
            self._meter = SavedActivationMeter().__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.activations, self._meter = self._meter.bytes, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.bytes is None:  # first step of this run; optimizer states exist from its 2nd step
            self.bytes = {}
        elif not self.bytes:  # optimizer states exist after step 1
            self.bytes = model_state_bytes(pl_module, trainer.optimizers).as_dict()


class RecordLogged(L.Callback):
    """Under pp the step runs once per microbatch on the last stage only: record what every rank logged."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train_loss"].detach().clone().float())


def run(args: argparse.Namespace) -> None:
    """One training run as the arguments say; rank 0 writes result.json and params.pt in --out."""
    L.seed_everything(0)
    # Built where the reference builds it (right after seeding), or later on the meta device.
    built = {"config": MODELS[args.model], "freeze": args.freeze, "optimizer_groups": args.optimizer_groups,
             "warmup_steps": args.warmup_steps}  # fmt: skip
    model = RecordingLM(**built) if args.build == "eager" else None
    if args.build == "configure":
        model = ConfiguredLM(**built)
    if args.zero == "auto":
        strategy = "5d"
    else:
        strategy = lightning_5d.FiveDStrategy(
            dp_replicate=args.dp_replicate,
            tp=args.tp,
            cp=args.cp,
            pp=args.pp,
            ep=args.ep,
            expert={"capacity_factor": args.capacity_factor, "load_balancing": args.balancing},
            pipeline={
                "schedule": args.schedule,
                "microbatches": args.microbatches,
                "virtual_stages": args.virtual_stages,
                "log_bubble": args.pp > 1,
            },
            context={"mode": args.cp_mode, "sharding": args.cp_sharding, "ulysses": args.cp_ulysses},
            sequence_parallel=args.sp,
            zero=int(args.zero),
            activation_checkpointing=args.ac,
            checkpoint_format=args.checkpoint_format,
            checkpoint_write=args.checkpoint_write,
            keep_last_k=args.keep_last_k,
            bucket_size_mb=0.05,
            verify=args.verify,
            pretrained=args.pretrained,
            model_plan=json.loads(args.model_plan) if args.model_plan else None,
        )
        if args.chunk_bytes is not None:  # small, so that the tiny model's tensors go the chunked way
            strategy._meta.chunk_bytes = args.chunk_bytes

    measure = MeasureModelState()
    logged_losses = RecordLogged()
    callbacks = [measure, logged_losses]
    if args.pretrained:
        callbacks.append(RecordLoaded(Path(args.out)))
    if args.unfreeze_at is not None:
        callbacks.append(Unfreeze(args.freeze, args.unfreeze_at))
    if args.save:
        callbacks.append(ModelCheckpoint(dirpath=args.out, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True))
    if args.save_every:
        every = ModelCheckpoint(dirpath=args.out, filename="{step}", save_top_k=-1, every_n_train_steps=args.save_every)
        callbacks.append(every)
    precision, plugins = args.precision, []
    if args.precision.startswith("fp8") or args.reduce_dtype != "fp32" or args.accumulation_dtype != "bf16":
        fp8 = {"fp8": {"fp8_all_gather": True}} if args.fp8_all_gather else {}
        guard = {"numerics_check_every": args.numerics_every} if args.numerics_every else {}
        dtypes = {"reduce_dtype": args.reduce_dtype, "accumulation_dtype": args.accumulation_dtype}
        plugin = lightning_5d.FiveDPrecision.from_string(args.precision, **dtypes, **fp8, **guard)
        precision, plugins = None, [plugin]
    if args.kill_during_save:
        import signal

        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            if trainer.global_step == args.kill_during_save and dist.get_rank() == dist.get_world_size() - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a node failure would
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = write_then_die
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        plugins=plugins,
        devices=int(os.environ["WORLD_SIZE"]),
        precision=precision,
        max_steps=-1 if args.max_epochs else args.steps,
        max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip,
        logger=False,
        enable_checkpointing=args.save or bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=args.val_batches,
        val_check_interval=args.steps if args.val_batches else None,
        callbacks=callbacks,
    )
    if args.build == "meta":
        with trainer.init_module(empty_init=True):
            model = RecordingLM(**built)
    batch_size = {"batch_size": args.batch_size} if args.batch_size else {}
    trainer.fit(model, datamodule=make_datamodule(args.num_samples, **batch_size), ckpt_path=args.resume)
    strategy = trainer.strategy

    losses = torch.stack(model.losses if args.pp == 1 else logged_losses.losses)
    dist.all_reduce(losses, group=strategy.mesh.group("dp"))
    losses /= strategy.mesh.data_size
    state = strategy.full_model_state()  # full tensors, whatever the layout
    per_rank = [None] * dist.get_world_size()
    logged = trainer.callback_metrics.get("train_loss")  # what the unchanged training_step logged last
    record = {
        **measure.bytes,
        "activations": measure.activations,
        "logged_train_loss": None if logged is None else float(logged),
        "fp8_loss_rel_diff": float(trainer.callback_metrics["fp8/loss_rel_diff"])
        if "fp8/loss_rel_diff" in trainer.callback_metrics
        else None,
        "logged_losses": [float(x) for x in logged_losses.losses],
        "val_loss": float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics else None,
    }
    record["chunked"] = strategy._meta.chunked  # names materialized in row chunks (--chunk-bytes)
    if args.pp > 1:
        record["peak_in_flight"] = strategy._pp.times.peak_in_flight
        record["bubble"] = float(trainer.callback_metrics["pp_bubble"])
    dist.all_gather_object(per_rank, record)
    if dist.get_rank() == 0:
        out = Path(args.out)
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "params.pt")
        layout = {**strategy.layout.sizes(), "ep": strategy.layout.ep, "zero": int(strategy.zero_stage)}
        layout["sp"] = strategy.config.sequence_parallel
        (out / "result.json").write_text(
            json.dumps({"losses": losses.tolist(), "model_state_bytes": per_rank, "layout": layout})
        )


def main(argv: list[str]) -> None:
    """One run, or with ``--cases FILE`` several in a row in the same processes.

    FILE is a JSON list of ``{"argv": [...], "out": dir}``: starting the ranks (importing torch and
    Lightning on every process) costs more than a small case, so the tests batch their cases.
    """
    cases = argparse.ArgumentParser(add_help=False)
    cases.add_argument("--cases")
    known, rest = cases.parse_known_args(argv)
    if known.cases is None:
        run(parser.parse_args(rest))
        return
    for case in json.loads(Path(known.cases).read_text()):
        Path(case["out"]).mkdir(parents=True, exist_ok=True)
        run(parser.parse_args([*case["argv"], "--out", case["out"]]))


if __name__ == "__main__":
    main(sys.argv[1:])
