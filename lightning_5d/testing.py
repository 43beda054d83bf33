"""Start a script on several local processes (gloo) with a hard timeout.

Used by the multi-process tests and the benchmarks. Two launchers (:class:`Launcher`):
``TORCHRUN`` is :func:`lightning_5d.launch.run_ranks`, as for ``l5d train``; ``FORK``
forks the ranks from an interpreter that already imported torch and Lightning
(:mod:`lightning_5d.fork_launch`), which saves the start-up of every rank. Either way a
hang becomes a failed run: on timeout every rank is stopped.
"""

from __future__ import annotations

import enum
import io
import os
import sys
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lightning_5d.fork_launch import run_forked_ranks
from lightning_5d.launch import run_ranks, worker_env


class Launcher(enum.Enum):
    """How :func:`run_distributed` starts the ranks."""

    TORCHRUN = "torchrun"  # fresh interpreters under torch.distributed.run: what users run
    FORK = "fork"  # forked from a preloaded server: same environment, no import cost per rank


@dataclass
class DistributedRun:
    returncode: int
    output: str
    timed_out: bool

    def check(self) -> "DistributedRun":
        if self.timed_out:  # the tail holds the ranks' stacks (fork_launch): room for several
            raise AssertionError(f"distributed run timed out; output tail:\n{self.output[-20000:]}")
        if self.returncode != 0:
            raise AssertionError(
                f"distributed run failed (exit {self.returncode}); output tail:\n{self.output[-6000:]}"
            )
        return self


def run_distributed(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    launcher: Launcher = Launcher.TORCHRUN,
) -> DistributedRun:
    extra = {"PYTHONWARNINGS": "ignore", **(env or {})}
    if launcher is Launcher.FORK:
        rc, text = run_forked_ranks(script, list(args), nproc, {**worker_env(), **extra}, timeout_s=timeout)
        return DistributedRun(-9 if rc is None else rc, text, timed_out=rc is None)
    output = io.StringIO()
    rc = run_ranks(
        [str(script), *args],
        nproc,
        [output],
        timeout_s=timeout,
        env=extra,
    )
    return DistributedRun(-9 if rc is None else rc, output.getvalue(), timed_out=rc is None)


def _stacks_and_exit_after(limit_s: float, what: str) -> None:
    """If this process still runs ``limit_s`` from now: its stacks to stderr, then exit 3."""
    import faulthandler
    import threading

    from lightning_5d.thread_stacks import native_stacks

    def report() -> None:
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: {what} did not finish in {limit_s:.0f} s; native stacks:", file=sys.stderr, flush=True)
        sys.stderr.write(native_stacks(os.getpid()))
        print(f"rank {rank}: Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(limit_s, report)
    timer.daemon = True
    timer.start()


def leave_process_group(limit_s: float = 120.0) -> None:
    """End a test script's rank: leave together, destroy the group, exit without teardown.

    Objects that still hold process groups (device meshes, autograd contexts, hooks) are
    otherwise destroyed during interpreter finalization, where gloo occasionally aborts a
    run that already finished ("terminate called without an active exception"; README,
    Known issues). Only for scripts that own their process, never for library code.

    A leave that has not finished after ``limit_s`` (twice, a launch did not return after its
    last result: README, Known issues) writes this rank's threads' stacks to stderr and exits
    with code 3, so that the launch fails at once and shows where it waited.
    """
    import torch.distributed as dist

    _stacks_and_exit_after(limit_s, "leaving the process group")
    if dist.is_initialized():
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))  # rank 0 acknowledges every rank
        else:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
