"""Start the ranks of a script forked from an interpreter that has already imported torch.

Starting a rank the usual way (``torchrun`` + a fresh ``python``) spends most of a short
run importing torch, Lightning and this package: about 5 CPU-seconds per process, plus
one more interpreter for ``torchrun`` itself. The multi-process tests start about a
hundred such runs, so on two cores imports alone took several minutes of the test tier.

Here the ranks come from Python's ``forkserver``: one server process imports the heavy
modules once (:data:`PRELOAD`), and every rank is a ``fork`` of it. The fork happens
before any torch operation has run in the server, so no thread pool or process group is
copied into the child. Each rank then gets the environment ``torchrun`` would give it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``/``MASTER_PORT``: what Lightning's ``TorchElasticEnvironment`` reads), and
runs the script as ``__main__``.

What ``torchrun`` does that this keeps: when one rank fails, the others are stopped (they
would otherwise wait in a collective until the time limit); a run past its time limit is
stopped as a whole (each rank leads its own process group, so anything it started goes
too); the exit code is 0 only when every rank exited 0. What it does not keep: live
streaming (each rank's output is collected in a file and returned rank by rank at the
end) and torchelastic's restarts. The requeue and signal tests use ``torchrun``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional, Sequence

from lightning_5d.thread_stacks import DUMP_SIGNAL, dump_python_stacks_on_signal, native_stacks

# Imported once by the fork server. A module that fails to import (an optional
# dependency missing) is skipped by the server; the rank then imports it itself.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "lightning",
    "lightning_5d",
    "lightning_5d.strategy",
    "lightning_5d.precision",
    "lightning_5d.models",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mixtral.modeling_mixtral",
)

# Thread settings every rank needs before its libraries start their thread pools; the
# server loads those libraries, so it must already run with them.
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started with :data:`PRELOAD` and one thread per library.

    Python keeps one fork server per process (multiprocessing's own); it is started on the
    first call and reused by every later one.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    saved = {k: os.environ.get(k) for k in _SERVER_ENV}
    os.environ.update(_SERVER_ENV)  # read by the server when it starts, and only then
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    # The server imports PRELOAD before it forks anything: wait for that here (one no-op
    # child, milliseconds once the server is up) so that it is not charged to a run's timeout.
    ready = ctx.Process(target=_ready)
    ready.start()
    ready.join()
    return ctx


def _ready() -> None:
    os._exit(0)


def _run_rank(script: str, args: Sequence[str], env: Mapping[str, str], log: str) -> None:
    """One rank, in a child of the fork server: environment, output file, then the script."""
    os.setpgid(0, 0)  # lead a process group: a timeout stops what this rank started too
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.update(env)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the server
    dump_python_stacks_on_signal()  # a rank stopped at the time limit shows where it waited
    import warnings

    if env.get("PYTHONWARNINGS") == "ignore":  # read only at interpreter start-up otherwise
        warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    import runpy
    import traceback

    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python script.py` does
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_stacks(processes: Sequence[multiprocessing.process.BaseProcess], logs: Sequence[str]) -> None:
    """Each rank still running: its threads' Python stacks (written by the rank itself on
    :data:`DUMP_SIGNAL`) and native stacks (gdb), at the end of its log."""
    running = [(proc, log) for proc, log in zip(processes, logs) if proc.pid is not None and proc.exitcode is None]
    for proc, _ in running:
        try:
            os.kill(proc.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # the ranks' handlers write to their logs
    with ThreadPoolExecutor(max(1, len(running))) as pool:  # gdb takes ~5 s per process
        stacks = list(pool.map(native_stacks, [proc.pid for proc, _ in running]))
    for (proc, log), found in zip(running, stacks):
        with open(log, "a") as out:
            out.write(f"\n--- rank process {proc.pid} still running: native stacks ---\n{found}")


def _kill(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for proc in processes:
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in processes:
        proc.join(timeout=10)


def _read_logs(paths: Sequence[str]) -> str:
    return "".join(Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in paths)


def _wait_for_ranks(
    procs: Sequence[multiprocessing.process.BaseProcess], deadline: Optional[float], failure_grace_s: float
) -> bool:
    """Wait until every rank has exited, or one failed ``failure_grace_s`` ago, or ``deadline``
    (time.monotonic) passed; True for the deadline.

    Each round reads each rank's exit code once: the ranks still running are the ones waited
    on. (Reading them twice, once to decide to wait and once to list whom to wait on, let a rank
    that exited in between leave an empty list, and a wait on nothing sleeps to the deadline:
    a finished run reported as hung at its time limit.)
    """
    failed_at = None
    while True:
        running = [p for p in procs if p.exitcode is None]
        if not running:
            return False
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return True
        if failed_at is not None and now >= failed_at + failure_grace_s:
            return False  # torchrun too stops the others once one rank has failed
        waits = [t for t in (deadline, failed_at and failed_at + failure_grace_s) if t]
        multiprocessing.connection.wait([p.sentinel for p in running], max(0.0, min(waits) - now) if waits else None)


def run_forked_ranks(
    script: str | Path,
    args: Sequence[str],
    nproc: int,
    env: Mapping[str, str],
    timeout_s: Optional[float] = None,
    failure_grace_s: float = 5.0,
) -> tuple[Optional[int], str]:
    """Run ``nproc`` ranks of ``script``; return (exit code or None on timeout, output).

    ``env``: added to each rank's environment (the rank variables are added here).
    ``failure_grace_s``: after the first rank fails, how long the others get to finish
    writing their own error before they are stopped.
    """
    ctx = _context()
    port = _free_port()
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RUN_ID": f"fork-{port}"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="l5d-ranks-") as logs:
        paths = [os.path.join(logs, f"rank{r}.log") for r in range(nproc)]
        procs = []
        for rank in range(nproc):
            rank_env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            procs.append(ctx.Process(target=_run_rank, args=(str(script), list(args), rank_env, paths[rank])))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        timed_out = False
        try:
            for proc in procs:
                proc.start()
            timed_out = _wait_for_ranks(procs, deadline, failure_grace_s)
            if timed_out:
                _report_stacks(procs, paths)
        except BaseException:
            # Stopped from outside (a test's own time limit, Ctrl-C): where the ranks waited goes
            # to this process's stderr, since no output is returned.
            _report_stacks(procs, paths)
            print(_read_logs(paths)[-20000:], file=sys.stderr, flush=True)
            raise
        finally:
            _kill(procs)
        output = _read_logs(paths)
    if timed_out:
        return None, output
    return (0 if all(p.exitcode == 0 for p in procs) else 1), output
