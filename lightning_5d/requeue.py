"""SLURM auto-requeue: save on a signal at the next optimizer step, requeue the job, exit cleanly.

SLURM warns a job before it ends it (``sbatch --signal=USR1@120``, or SIGTERM on preemption
and ``scancel``). Doing the work inside the signal handler, as Lightning's own SLURM handler
does, runs a collective save on whichever rank got the signal at whatever point it was
interrupted, possibly inside another collective: the ranks then deadlock or write mixed
steps. So here the handler only sets a flag, and :class:`AutoRequeue` acts at the next
optimizer-step boundary, where every rank is at the same step:

1. the ranks agree whether any of them got a signal (one small all-reduce, MAX);
2. all ranks call ``trainer.save_checkpoint(<dirpath>/requeue-step=<N>.ckpt, weights_only=False)`` together;
3. rank 0 runs the requeue command (``scontrol requeue {job_id}``) and tells the others
   how it went; a failing command raises on every rank, after the checkpoint is safe;
4. ``trainer.should_stop = True``: ``fit`` returns and the process exits 0.

The requeued job runs the same command line and resumes by itself::

    requeue = AutoRequeue(dirpath="checkpoints/requeue")
    trainer = L.Trainer(strategy="5d", callbacks=[requeue])
    trainer.fit(model, ckpt_path=AutoRequeue.resume_path("checkpoints/requeue"))  # None on a first start

``l5d train`` wires this from the ``requeue:`` and ``resume:`` keys of its config
(:func:`job_setup`); docs/checkpoints.md, "SLURM: requeue on a signal".
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

SignalSpec = Union[str, int, signal.Signals]
CommandSpec = Union[str, Sequence[str]]
# What lightning_5d/worker_boot.py recorded before the imports: ({signal: handler before it}, [received]).
EarlySignals = tuple[Mapping[signal.Signals, Any], Sequence[signal.Signals]]

DEFAULT_SIGNALS: tuple[str, ...] = ("SIGUSR1", "SIGTERM")
DEFAULT_COMMAND = "scontrol requeue {job_id}"
JOB_ID_FIELD = "{job_id}"
# scontrol talks to slurmctld, which can be unreachable; the checkpoint is already safe by
# then, so waiting longer than SLURM's grace period buys nothing.
COMMAND_TIMEOUT_S = 60.0
CHECKPOINT_PREFIX = "requeue-step="


class RequeueError(RuntimeError):
    """The requeue command failed (the checkpoint it follows was saved)."""


class RequeueConfigError(ValueError):
    """A ``requeue:`` / ``resume:`` setting that cannot work."""


class RequeueOutcome(str, Enum):
    """What :class:`AutoRequeue` did after a signal."""

    REQUEUED = "requeued"  # saved, and the requeue command succeeded
    SAVED_NO_JOB = "saved_no_job"  # saved; the command needs a SLURM job id and there is none


class ResumeMode(str, Enum):
    """Where a run starts (``resume:`` in the ``l5d train`` config)."""

    AUTO = "auto"  # the newest complete checkpoint in the requeue directory, if there is one
    NONE = "none"  # from scratch
    PATH = "path"  # the given checkpoint


# --------------------------------------------------------------------------- signals


def parse_signal(spec: SignalSpec) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"``, ``"usr1"``, ``10`` or ``signal.SIGUSR1`` -> ``signal.SIGUSR1``."""
    if isinstance(spec, signal.Signals):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        try:
            return signal.Signals(spec)
        except ValueError:
            pass
    elif isinstance(spec, str):
        name = spec.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in signal.Signals.__members__:
            return signal.Signals[name]
    catchable = sorted(s.name for s in signal.valid_signals() if isinstance(s, signal.Signals))
    raise RequeueConfigError(
        f"unknown signal {spec!r}; use a name such as SIGUSR1 or SIGTERM (this platform: {catchable})"
    )


def parse_signals(specs: Union[SignalSpec, Sequence[SignalSpec]]) -> tuple[signal.Signals, ...]:
    if isinstance(specs, (str, int, signal.Signals)):
        specs = [specs]
    parsed = tuple(dict.fromkeys(parse_signal(s) for s in specs))  # ordered, without repeats
    if not parsed:
        raise RequeueConfigError("requeue signals: the list is empty; give at least one, e.g. [SIGUSR1, SIGTERM]")
    uncatchable = [s.name for s in parsed if s in (signal.SIGKILL, signal.SIGSTOP)]
    if uncatchable:
        raise RequeueConfigError(f"requeue signals: {uncatchable} cannot be caught; use SIGUSR1, SIGUSR2 or SIGTERM")
    return parsed


class SignalFlag:
    """Handlers for ``signals`` that only record that one arrived.

    A Python handler runs on the main thread between two bytecodes, possibly in the middle
    of a collective or a checkpoint write; setting an attribute is the only thing that is
    safe there. :meth:`install` must run on the main thread (``signal.signal`` refuses
    other threads); :meth:`restore` puts back what was there before.
    """

    def __init__(self, signals: Sequence[SignalSpec] = DEFAULT_SIGNALS) -> None:
        self.signals = parse_signals(signals)
        self.received: Optional[signal.Signals] = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received = signal.Signals(signum)

    def clear(self) -> None:
        self.received = None

    def owns(self, signum: signal.Signals) -> bool:
        """Whether this flag is the handler of ``signum`` right now."""
        return signal.getsignal(signum) is self

    def install(self) -> bool:
        """Become the handler of every signal; False (and nothing changed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.signals:
            if self.owns(signum):
                continue  # installed already: keep the handler from before the first install
            self._previous[signum] = signal.signal(signum, self)
        return True

    def reinstall(self) -> dict[signal.Signals, Any]:
        """Take back signals another handler replaced since :meth:`install`; returns {signal: that handler}."""
        taken: dict[signal.Signals, Any] = {}
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return taken
        for signum in self.signals:
            if not self.owns(signum):
                taken[signum] = signal.signal(signum, self)
        return taken

    def take_over(self, early: Optional[EarlySignals]) -> None:
        """Install, taking over from a start-up catcher (lightning_5d/worker_boot.py): the signals it
        recorded count as received here, and restore() puts back what was there before it.

        A recorded signal this flag does not handle gets its own previous handler back and is
        delivered again, so it ends the process as it would have without the catcher.
        """
        previous, received = early if early is not None else ({}, [])
        if not self.install():
            return
        for signum, handler in previous.items():
            if signum in self._previous:
                self._previous[signum] = handler  # the handler from before the catcher
            else:
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        mine = [s for s in received if s in self.signals]
        if mine and self.received is None:
            self.received = mine[0]
        for signum in dict.fromkeys(s for s in received if s not in self.signals):
            signal.raise_signal(signum)

    def previous(self, signum: signal.Signals) -> Any:
        """The handler :meth:`restore` puts back for ``signum``."""
        handler = self._previous.get(signum)
        # None: the previous handler was not set from Python; the default is the closest we can put back.
        return signal.SIG_DFL if handler is None else handler

    def restore(self) -> None:
        """Put back the handlers from before :meth:`install`, where this flag is still the handler."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in list(self._previous):
            # Someone else's handler installed after ours is theirs to remove.
            if self.owns(signum):
                signal.signal(signum, self.previous(signum))
            del self._previous[signum]


# --------------------------------------------------------------------------- the command


def job_id_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    job_id = (os.environ if env is None else env).get("SLURM_JOB_ID", "").strip()
    return job_id or None


def command_needs_job_id(command: CommandSpec) -> bool:
    args = [command] if isinstance(command, str) else list(command)
    return any(JOB_ID_FIELD in str(a) for a in args)


def command_argv(command: CommandSpec, job_id: Optional[str]) -> list[str]:
    """The argument vector to run: a string is split like a shell would (no shell runs it).

    ``{job_id}`` is replaced by plain substitution rather than ``str.format`` so that other
    braces in a custom command stay as written.
    """
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise RequeueConfigError("requeue command is empty; the default is 'scontrol requeue {job_id}'")
    if command_needs_job_id(argv):
        if job_id is None:
            raise RequeueConfigError(f"requeue command {shlex.join(argv)!r} needs {JOB_ID_FIELD}, and none is set")
        argv = [a.replace(JOB_ID_FIELD, job_id) for a in argv]
    return argv


def run_command(argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str]:
    """Run ``argv``; returns (exit code, its output). A missing program or a timeout counts as a failure."""
    try:
        done = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", timeout=timeout_s
        )
    except FileNotFoundError as err:
        return 127, f"{err.strerror}: {argv[0]!r} (not on PATH?)"
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {timeout_s:g} s"
    except OSError as err:
        return 126, str(err)
    return done.returncode, (done.stdout + done.stderr).strip()


# --------------------------------------------------------------------------- the callback


class AutoRequeue(pl.Callback):
    """Save at the next optimizer step after a signal, requeue the SLURM job, stop ``fit`` cleanly.

    Args:
        dirpath: where ``requeue-step=<N>.ckpt`` goes; pass the same folder to
            :meth:`resume_path` in the requeued job.
        signals: the signals that ask for a requeue. SLURM sends SIGTERM on preemption,
            ``scancel`` and at the time limit; ``sbatch --signal=USR1@<seconds>`` sends the
            chosen one that long before the time limit (submitit uses SIGUSR2).
        command: run on rank 0 after the save; a string (split like a shell, but no shell
            runs it) or an argument list; ``{job_id}`` becomes ``$SLURM_JOB_ID``.
        check_every_n_steps: how often the ranks compare flags (one scalar all-reduce each
            time); a signal waits at most this many optimizer steps.
    """

    def __init__(
        self,
        dirpath: Union[str, os.PathLike],
        signals: Sequence[SignalSpec] = DEFAULT_SIGNALS,
        command: CommandSpec = DEFAULT_COMMAND,
        check_every_n_steps: int = 1,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) or check_every_n_steps < 1:
            raise RequeueConfigError(f"check_every_n_steps={check_every_n_steps!r} must be a positive integer")
        command_argv(command, job_id="0")  # an empty command fails here, not at the first signal
        self.dirpath = Path(dirpath)
        self.flag = SignalFlag(signals)
        self.command = command
        self.check_every_n_steps = check_every_n_steps
        self.command_timeout_s = command_timeout_s
        self.outcome: Optional[RequeueOutcome] = None
        self.saved: Optional[Path] = None
        self._checked_step = -1
        self._fitted = False

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        return self.flag.signals

    @staticmethod
    def resume_path(dirpath: Union[str, os.PathLike]) -> Optional[Path]:
        """The newest complete checkpoint in ``dirpath``, or None (a first start): ``fit(ckpt_path=...)``."""
        from lightning_5d.checkpoint import latest_checkpoint

        return latest_checkpoint(dirpath) if Path(dirpath).is_dir() else None

    def checkpoint_path(self, step: int) -> Path:
        return self.dirpath / f"{CHECKPOINT_PREFIX}{step}.ckpt"

    # ---------------------------------------------------------------- handlers

    def install(self, early: Optional[EarlySignals] = None) -> None:
        """Catch the signals from now on, not only from ``fit``'s start: call it first thing in a
        script, so that a preemption notice during imports, setup or the checkpoint restore is
        remembered and acted on at the first optimizer step (save, requeue). ``early``: what a
        start-up catcher recorded (``l5d train``'s workers start with one)."""
        if threading.current_thread() is not threading.main_thread():
            return  # on_fit_start warns
        self.flag.take_over(early)
        if self.flag.received is not None:
            rank_zero_info(f"[lightning_5d] AutoRequeue: {self.flag.received.name} arrived during start-up")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A signal received before the first fit (start-up, setup, the checkpoint restore) is kept:
        # the first optimizer step acts on it. One from an earlier fit was handled or reported there.
        if self._fitted:
            self.flag.clear()
        self.outcome, self.saved, self._checked_step = None, None, -1
        if not self.flag.install():
            rank_zero_warn(
                "AutoRequeue: fit runs off the main thread, where Python cannot set signal handlers; "
                f"{[s.name for s in self.signals]} keep their current handlers and nothing is requeued."
            )

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Lightning (2.6) registers its own handlers after on_fit_start: SIGTERM always, wrapping
        # ours behind one that runs a broadcast inside the handler, and SIGUSR1 when its
        # SLURMEnvironment(auto_requeue=True) finds no handler there. Ours must be the one that runs.
        self._checked_step = trainer.global_step  # a resumed run has not stepped yet either
        taken = self.flag.reinstall()
        # Lightning's teardown puts back what it found, which was our handler; make it put back
        # what was there before fit, so that a failed fit does not leave our handler behind.
        saved = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
        if isinstance(saved, dict):
            for signum in self.signals:
                if saved.get(signum) is self.flag:
                    saved[signum] = self.flag.previous(signum)
        if taken:
            names = ", ".join(sorted(s.name for s in taken))
            rank_zero_info(
                f"[lightning_5d] AutoRequeue: took {names} back from the handlers Lightning set at fit start"
            )

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        # Only where an optimizer step just happened (not between accumulated micro-batches),
        # and at the same steps on every rank, since the decision is a collective.
        if step == self._checked_step or step % self.check_every_n_steps:
            return
        self._checked_step = step
        if self.outcome is not None or _last_step(trainer):
            return  # a signal with no step left to train asks for nothing: on_train_end says so
        if not trainer.strategy.reduce_boolean_decision(self.flag.received is not None, all=False):
            return
        self._save_and_requeue(trainer, step)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.outcome is None and self.flag.received is not None:
            # Only the rank that got the signal knows; the job is done and has nothing to resume.
            print(
                f"[lightning_5d] AutoRequeue (rank {trainer.global_rank}): {self.flag.received.name} arrived "
                "during or after the last step; training finished, nothing requeued",
                flush=True,
            )

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self.flag.restore()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.flag.restore()
        self._fitted = True

    # ---------------------------------------------------------------- the work

    def _save_and_requeue(self, trainer: "pl.Trainer", step: int) -> None:
        received = self.flag.received.name if self.flag.received is not None else "a signal on another rank"
        path = self.checkpoint_path(step)
        rank_zero_info(f"[lightning_5d] AutoRequeue: {received}; saving {path} at step {step}")
        trainer.save_checkpoint(path, weights_only=False)  # collective: every rank is here at the same step
        # An asynchronous save returns before its files are published; the requeue ends this job.
        checkpoints = getattr(trainer.strategy, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.wait()
        self.saved = path

        job_id = job_id_from_env()
        if command_needs_job_id(self.command) and job_id is None:
            self.outcome = RequeueOutcome.SAVED_NO_JOB
            rank_zero_warn(
                f"AutoRequeue: saved {path}, but SLURM_JOB_ID is not set, so there is no job to requeue; "
                f"stopping. Resume with fit(ckpt_path=AutoRequeue.resume_path({str(self.dirpath)!r}))."
            )
            _stop(trainer)
            return

        argv = command_argv(self.command, job_id)
        result: Optional[tuple[int, str]] = None
        if trainer.is_global_zero:
            rank_zero_info(f"[lightning_5d] AutoRequeue: running {shlex.join(argv)}")
            result = run_command(argv, self.command_timeout_s)
        # Every rank learns the result, so that all of them stop or all of them raise: a lone
        # failing rank would leave the others waiting in a later collective.
        code, output = trainer.strategy.broadcast(result, src=0)
        if code != 0:
            raise RequeueError(
                f"requeue command {shlex.join(argv)!r} failed with exit code {code}"
                + (f": {output}" if output else "")
                + f". The checkpoint {path} is complete; resubmit the job to resume from it."
            )
        self.outcome = RequeueOutcome.REQUEUED
        rank_zero_info(
            f"[lightning_5d] AutoRequeue: requeued job {job_id} ({shlex.join(argv)})"
            + (f": {output}" if output else "")
            + "; stopping"
        )
        _stop(trainer)


def _last_step(trainer: "pl.Trainer") -> bool:
    """Whether the optimizer step just taken ends training (the same answer on every rank)."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(max_epochs is not None and max_epochs > 0 and trainer.is_last_batch) and (
        trainer.current_epoch + 1 >= max_epochs
    )


def _stop(trainer: "pl.Trainer") -> None:
    trainer.should_stop = True
    fit_loop = trainer.fit_loop
    # Lightning ignores should_stop until min_steps / min_epochs are met; the job is ending
    # anyway (SLURM kills it after the grace period), and the requeued job trains the rest.
    if not getattr(fit_loop, "_can_stop_early", True):
        rank_zero_warn("AutoRequeue: stopping before min_steps/min_epochs; the requeued job trains the rest.")
        fit_loop.min_epochs = 0
        fit_loop.epoch_loop.min_steps = 0


# --------------------------------------------------------------------------- l5d train


@dataclass
class RequeueConfig:
    """The ``requeue:`` section of the ``l5d train`` config."""

    enabled: bool = False
    signals: tuple[str, ...] = DEFAULT_SIGNALS
    command: CommandSpec = DEFAULT_COMMAND
    dirpath: str = "checkpoints/requeue"
    check_every_n_steps: int = 1

    @classmethod
    def from_mapping(cls, values: Optional[Mapping[str, Any]]) -> "RequeueConfig":
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise RequeueConfigError(f"requeue: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        config = cls(**values)
        if not isinstance(config.enabled, bool):
            raise RequeueConfigError(f"requeue.enabled={config.enabled!r} must be true or false")
        parse_signals(config.signals)
        command_argv(config.command, job_id="0")
        if not config.dirpath:
            raise RequeueConfigError("requeue.dirpath is empty; it is where the requeue checkpoints go")
        steps = config.check_every_n_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise RequeueConfigError(f"requeue.check_every_n_steps={steps!r} must be a positive integer")
        return config

    def callback(self) -> AutoRequeue:
        return AutoRequeue(self.dirpath, self.signals, self.command, self.check_every_n_steps)


def resume_mode(resume: Optional[str]) -> ResumeMode:
    text = "none" if resume is None else str(resume).strip()
    if text.lower() in (ResumeMode.AUTO.value, ResumeMode.NONE.value):
        return ResumeMode(text.lower())
    if not text:
        raise RequeueConfigError("resume is empty; use auto, none or a checkpoint path")
    return ResumeMode.PATH


def resume_checkpoint(resume: Optional[str], dirpath: Union[str, os.PathLike]) -> Optional[Path]:
    """The ``ckpt_path`` for ``fit``: auto -> newest complete one in ``dirpath`` (None if none)."""
    mode = resume_mode(resume)
    if mode == ResumeMode.NONE:
        return None
    if mode == ResumeMode.AUTO:
        return AutoRequeue.resume_path(dirpath)
    path = Path(str(resume))
    if not path.exists():
        raise RequeueConfigError(f"resume={str(resume)!r}: no such checkpoint; use auto, none or an existing path")
    return path


@dataclass
class JobRequeue:
    """What a worker adds to its Trainer for the ``requeue:`` / ``resume:`` keys."""

    callback: Optional[AutoRequeue] = None
    plugins: list = field(default_factory=list)
    ckpt_path: Optional[Path] = None

    @property
    def callbacks(self) -> list:
        return [] if self.callback is None else [self.callback]

    def after_fit(self) -> None:
        """Leave without a result once the job is requeued, when submitit runs it.

        submitit takes a normal return for the job's result and its submitter stops waiting,
        though the requeued job is about to run again; exiting without a result is how
        submitit's own requeue leaves, so the submitter follows the job into its next run.
        """
        requeued = self.callback is not None and self.callback.outcome == RequeueOutcome.REQUEUED
        if requeued and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
            raise SystemExit(0)


def validate_job(cfg: Mapping[str, Any]) -> None:
    """Raise :class:`RequeueConfigError` for bad ``requeue:`` / ``resume:`` keys (before any worker starts)."""
    config = RequeueConfig.from_mapping(cfg.get("requeue"))
    resume = cfg.get("resume")
    if resume_mode(resume) == ResumeMode.PATH:
        resume_checkpoint(resume, config.dirpath)


def job_setup(
    cfg: Mapping[str, Any],
    plugins: Sequence[Any] = (),
    early: Optional[EarlySignals] = None,
) -> JobRequeue:
    """Callbacks, plugins and ``ckpt_path`` for one ``l5d train`` worker.

    ``plugins``: those the worker passes already; a cluster environment among them is kept.
    ``early``: what the worker's start-up catcher recorded (lightning_5d/worker_boot.py). The
    handlers are installed here, before the Trainer exists, so that a signal during setup or the
    checkpoint restore is acted on at the first optimizer step.
    """
    config = RequeueConfig.from_mapping(cfg.get("requeue"))
    requeued = AutoRequeue.resume_path(config.dirpath) if config.enabled else None
    # A requeued job continues from its own newest checkpoint whatever `resume` says: with a
    # fixed path (or none) every requeue would start over from the same point.
    setup = JobRequeue(ckpt_path=requeued or resume_checkpoint(cfg.get("resume"), config.dirpath))
    if config.enabled:
        setup.callback = config.callback()
        setup.callback.install(early)
        setup.plugins = _slurm_environment(plugins)
    elif early is not None:
        _hand_back(early)
    if setup.ckpt_path is not None:
        rank_zero_info(f"[lightning_5d] resuming from {setup.ckpt_path}")
    return setup


def _hand_back(early: EarlySignals) -> None:
    """No requeue: the start-up catcher's signals get their own handlers back, and one that
    arrived meanwhile is delivered again (ending the process as it would have)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous, received = early
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    for signum in dict.fromkeys(received):
        signal.raise_signal(signum)


def _slurm_environment(plugins: Sequence[Any]) -> list:
    """Lightning's SLURMEnvironment with its own requeue off, where Lightning would detect SLURM.

    Its auto-requeue saves and calls scontrol from inside the signal handler; with both on, a
    signal would be handled twice.
    """
    from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment

    if any(isinstance(p, ClusterEnvironment) for p in plugins) or not SLURMEnvironment.detect():
        return []
    return [SLURMEnvironment(auto_requeue=False)]


__all__ = [
    "AutoRequeue",
    "JobRequeue",
    "RequeueConfig",
    "RequeueConfigError",
    "RequeueError",
    "RequeueOutcome",
    "ResumeMode",
    "SignalFlag",
    "command_argv",
    "job_setup",
    "parse_signals",
    "resume_checkpoint",
    "validate_job",
]
