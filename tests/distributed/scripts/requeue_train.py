"""A training run that may get a requeue signal mid-epoch, and resumes by itself when started again.

Started by tests/distributed/test_requeue.py under torch.distributed.run, with the same
command line and environment each time (as a requeued SLURM job is): it resumes from
``AutoRequeue.resume_path(--dirpath)`` when there is a checkpoint there. With ``--send-signal``,
rank ``--send-on-rank`` sends that signal to itself in the middle of optimizer step
``--send-at-step`` (between forward and backward); a resumed run starts after that step and
so does not send it again. Rank 0 writes ``--out``/result-<start step>.json: the per-step
losses averaged over the data ranks, a fingerprint of every rank's batches, what
AutoRequeue did, and the signal handlers in place after fit.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

import lightning_5d
from lightning_5d.requeue import AutoRequeue
from tests_support import TINY, RecordingLM, make_datamodule

parser = argparse.ArgumentParser()
parser.add_argument("--dirpath", required=True, help="AutoRequeue's folder; resumed from when it holds a checkpoint")
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--num-samples", type=int, default=None)
parser.add_argument("--zero", type=int, default=1)
parser.add_argument("--send-signal", default=None, help="e.g. SIGUSR1 or SIGTERM; none: an uninterrupted run")
parser.add_argument("--send-at-step", type=int, default=3)
parser.add_argument("--send-on-rank", type=int, default=1)
parser.add_argument("--send-before-fit", action="store_true", help="send it during start-up, before the Trainer exists")
parser.add_argument("--fresh", action="store_true", help="start from scratch even if --dirpath holds checkpoints")
args = parser.parse_args()


class SignalMidStep(L.Callback):
    """The signal arrives inside a step, as SLURM's would: between this rank's forward and backward."""

    def __init__(self, signum, step, rank):
        self.signum, self.step, self.rank = signum, step, rank
        self.sent = False

    def on_before_backward(self, trainer, pl_module, loss):
        if not self.sent and trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.sent = True
            os.kill(os.getpid(), self.signum)


class Record(L.Callback):
    """Where the run started, and a fingerprint of each batch this rank trained on."""

    def __init__(self):
        self.start_step = None
        self.batches = []
        self.handlers_in_training = {}

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids = batch["input_ids"]
        self.batches.append(int((ids * torch.arange(1, ids.numel() + 1).view_as(ids)).sum()))
        if not self.handlers_in_training:
            self.handlers_in_training = {s.name: type(signal.getsignal(s)).__name__ for s in requeue.signals}


before_fit = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
L.seed_everything(0)
model = RecordingLM(config=TINY)
requeue = AutoRequeue(args.dirpath)
requeue.install()  # from here on a signal is remembered, also during setup and the checkpoint restore
record = Record()
callbacks = [record, requeue]
if args.send_signal and args.send_before_fit:
    if int(os.environ["RANK"]) == args.send_on_rank:
        os.kill(os.getpid(), signal.Signals[args.send_signal])
elif args.send_signal:
    callbacks.insert(0, SignalMidStep(signal.Signals[args.send_signal], args.send_at_step, args.send_on_rank))
resume = None if args.fresh else AutoRequeue.resume_path(args.dirpath)
trainer = L.Trainer(
    accelerator="cpu",
    strategy=lightning_5d.FiveDStrategy(zero=args.zero),
    devices=int(os.environ["WORLD_SIZE"]),
    precision="32-true",
    max_steps=args.steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    num_sanity_val_steps=0,
    callbacks=callbacks,
)
trainer.fit(model, datamodule=make_datamodule(args.num_samples), ckpt_path=resume)

losses = torch.stack(model.losses)
dist.all_reduce(losses)
losses /= dist.get_world_size()
per_rank = [None] * dist.get_world_size()
received = None if requeue.flag.received is None else requeue.flag.received.name
dist.all_gather_object(per_rank, (record.batches, received))
if dist.get_rank() == 0:
    result = {
        "resumed_from": None if resume is None else str(resume),
        "start_step": record.start_step,
        "end_step": trainer.global_step,
        "losses": losses.tolist(),
        "batches": [batches for batches, _ in per_rank],
        "outcome": None if requeue.outcome is None else requeue.outcome.value,
        "saved": None if requeue.saved is None else str(requeue.saved),
        "received": [name for _, name in per_rank],
        "handlers_in_training": record.handlers_in_training,
        "handlers_restored": all(signal.getsignal(s) is h for s, h in before_fit.items()),
    }
    (Path(args.out) / f"result-{record.start_step}.json").write_text(json.dumps(result))
